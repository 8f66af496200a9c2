"""Write the quickstart dataset: small string and arithmetic tasks a tiny model learns in minutes.

Deterministic (fixed seed): running it again rewrites identical files. Each task appears in
`alpaca` form (instruction, input, output) and `messages` form (chat turns). Eval rows are
disjoint from training rows.

    python examples/make_data.py [--out examples/data] [--train 3000] [--eval 200]
"""

import argparse
import json
import random
import string
from pathlib import Path


def make_example(rng: random.Random) -> dict:
    task = rng.choice(["reverse", "upper", "add", "sort"])
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    if task == "reverse":
        return {"instruction": "Reverse the letters.", "input": word, "output": word[::-1]}
    if task == "upper":
        return {"instruction": "Write in capitals.", "input": word, "output": word.upper()}
    if task == "sort":
        return {"instruction": "Sort the letters.", "input": word, "output": "".join(sorted(word))}
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return {"instruction": "Add the numbers.", "input": f"{a}+{b}", "output": str(a + b)}


def as_messages(row: dict) -> dict:
    return {"messages": [{"role": "user", "content": f"{row['instruction']} {row['input']}"},
                         {"role": "assistant", "content": row["output"]}]}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "data"))
    parser.add_argument("--train", type=int, default=3000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    seen, rows = set(), []
    while len(rows) < args.train + args.eval:
        row = make_example(rng)
        key = (row["instruction"], row["input"])
        if key not in seen:
            seen.add(key)
            rows.append(row)
    train, evaluation = rows[: args.train], rows[args.train:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "tasks_train.jsonl", train)
    write_jsonl(out / "tasks_eval.jsonl", evaluation)
    write_jsonl(out / "tasks_messages_train.jsonl", [as_messages(r) for r in train])
    write_jsonl(out / "tasks_messages_eval.jsonl", [as_messages(r) for r in evaluation])
    print(f"wrote {len(train)} train and {len(evaluation)} eval rows to {out}")


if __name__ == "__main__":
    main()
