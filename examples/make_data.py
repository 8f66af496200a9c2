"""Write the quickstart dataset: small string and number tasks, most of which a tiny model learns
in the quickstart's two minutes (first and last letter, letter count, even or odd, single-digit
sums) and one it does not (writing a word in capitals, which needs copying every letter).
Single-digit sums have only 100 distinct rows, all of them in the training set, so none is held out.

Deterministic (fixed seed): running it again rewrites identical files. Each task appears in
`alpaca` form (instruction, input, output) and `messages` form (chat turns), and as preference
pairs (TRL's conversational preference format: the right answer chosen, a wrong one rejected), and
as prompts with their answers (online RL: TRL's prompt-only format plus an `answer` column).
Eval rows are disjoint from training rows.

    python examples/make_data.py [--out examples/data] [--train 3000] [--eval 200]
"""

import argparse
import json
import random
import string
from pathlib import Path


def make_example(rng: random.Random) -> dict:
    task = rng.choice(["first", "last", "count", "upper", "add", "parity"])
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7)))
    if task == "first":
        return {"instruction": "First letter.", "input": word, "output": word[0]}
    if task == "last":
        return {"instruction": "Last letter.", "input": word, "output": word[-1]}
    if task == "count":
        return {"instruction": "Count the letters.", "input": word, "output": str(len(word))}
    if task == "upper":
        return {"instruction": "Write in capitals.", "input": word, "output": word.upper()}
    if task == "parity":
        n = rng.randint(0, 999)
        return {"instruction": "Even or odd?", "input": str(n), "output": "even" if n % 2 == 0 else "odd"}
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"instruction": "Add the numbers.", "input": f"{a}+{b}", "output": str(a + b)}


def as_messages(row: dict) -> dict:
    return {"messages": [{"role": "user", "content": f"{row['instruction']} {row['input']}"},
                         {"role": "assistant", "content": row["output"]}]}


def wrong_answer(row: dict, rng: random.Random) -> str:
    """A plausible wrong answer to a task row: another letter, a count or sum off by a little, the
    other parity, capitals with one letter changed."""
    right = row["output"]
    if right.isdigit():
        return str(max(0, int(right) + rng.choice([-2, -1, 1, 2])) if right != "0" else rng.randint(1, 3))
    if right in ("even", "odd"):
        return "odd" if right == "even" else "even"
    if len(right) == 1:
        return rng.choice([c for c in string.ascii_lowercase if c != right])
    i = rng.randrange(len(right))
    return right[:i] + rng.choice([c for c in string.ascii_uppercase if c != right[i]]) + right[i + 1:]


def as_preference(row: dict, rng: random.Random) -> dict:
    prompt = [{"role": "user", "content": f"{row['instruction']} {row['input']}"}]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": row["output"]}],
            "rejected": [{"role": "assistant", "content": wrong_answer(row, rng)}]}


def as_unpaired(row: dict, rng: random.Random) -> dict:
    """KTO's unpaired rows: the right answer labelled desirable, or (half of the rows) a wrong one
    labelled undesirable."""
    good = rng.random() < 0.5
    return {"prompt": [{"role": "user", "content": f"{row['instruction']} {row['input']}"}],
            "completion": [{"role": "assistant", "content": row["output"] if good else wrong_answer(row, rng)}],
            "label": good}


def as_prompt(row: dict) -> dict:
    """Online RL's prompt-only rows: the user turn, and the answer a reward function checks."""
    return {"prompt": [{"role": "user", "content": f"{row['instruction']} {row['input']}"}], "answer": row["output"]}


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
    wrong = random.Random(args.seed + 1)  # its own stream: the files above stay as they were
    write_jsonl(out / "tasks_preference_train.jsonl", [as_preference(r, wrong) for r in train])
    write_jsonl(out / "tasks_preference_eval.jsonl", [as_preference(r, wrong) for r in evaluation])
    write_jsonl(out / "tasks_prompts_train.jsonl", [as_prompt(r) for r in train])
    write_jsonl(out / "tasks_prompts_eval.jsonl", [as_prompt(r) for r in evaluation])
    # LoRA's quickstart: a task the SFT quickstart never saw (second letter), half of its rows, the
    # other half the tasks it knows (so that the adapter adds a skill without losing those).
    new = random.Random(args.seed + 2)  # its own stream again
    second = []
    while len(second) < args.train // 2 + args.eval // 2:
        word = "".join(new.choice(string.ascii_lowercase) for _ in range(new.randint(3, 7)))
        if ("Second letter.", word) not in seen:
            seen.add(("Second letter.", word))
            second.append({"instruction": "Second letter.", "input": word, "output": word[1]})
    lora_train = second[: args.train // 2] + train[: args.train // 2]
    new.shuffle(lora_train)
    lora_eval = second[args.train // 2:] + evaluation[: args.eval // 2]
    write_jsonl(out / "tasks_lora_train.jsonl", [as_messages(r) for r in lora_train])
    write_jsonl(out / "tasks_lora_eval.jsonl", [as_messages(r) for r in lora_eval])
    unpaired = random.Random(args.seed + 3)  # its own stream: the files above stay as they were
    write_jsonl(out / "tasks_unpaired_train.jsonl", [as_unpaired(r, unpaired) for r in train])
    write_jsonl(out / "tasks_unpaired_eval.jsonl", [as_unpaired(r, unpaired) for r in evaluation])
    print(f"wrote {len(train)} train and {len(evaluation)} eval rows to {out}")


if __name__ == "__main__":
    main()
