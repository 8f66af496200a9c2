"""Write the tool quickstart's data (examples/recipes/quickstart_tools_sft.yaml, then quickstart_tools_grpo.yaml):
the quickstart's "Add the numbers." task with two-digit numbers ("Add the numbers. 37+58" -> "95"), which the tiny
model does not learn to answer by itself in a few minutes, and a calculator tool (examples/tools.py:add) that does.

- tasks_tools_messages_{train,eval}.jsonl: chat transcripts for the SFT stage, each with the tool's schema in a
  `tools` column (rendered into the prompt exactly as the GRPO run renders rl.tools). Half of them call the
  tool (assistant turn with `tool_calls`, the `tool` turn with its result, then the answer), half answer directly
  (the right answer, without the tool). So the SFT model learns the call format and how to read a result, but not
  that the tool is the better way: sampled, it calls the tool about half of the time.
- tasks_tools_prompts_{train,eval}.jsonl: prompt-only rows with their `answer` for GRPO (TRL's format), rows no
  transcript above holds. GRPO's reward is the exact answer; it has to find that the calls are what earns it.

Deterministic (fixed seed): running it again rewrites identical files. Eval rows are disjoint from training rows.

    python examples/make_tool_data.py [--out examples/data] [--sft 2000] [--rl 1000] [--eval 200]
"""

import argparse
import importlib.util
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def tool_schemas() -> list[dict]:
    """examples/tools.py's tools as the chat template receives them (transformers' get_json_schema, as rl.tools)."""
    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("quickstart_tools", HERE / "tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [get_json_schema(module.add)]


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"Add the numbers. {a}+{b}"}]


def transcript(a: int, b: int, use_tool: bool, tools: list[dict]) -> dict:
    answer = {"role": "assistant", "content": str(a + b)}
    if not use_tool:
        return {"messages": question(a, b) + [answer], "tools": tools}
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return {"messages": question(a, b) + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                          {"role": "tool", "name": "add", "content": str(a + b)}, answer],
            "tools": tools}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "data"))
    parser.add_argument("--sft", type=int, default=2000)
    parser.add_argument("--rl", type=int, default=1000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pairs = rng.sample([(a, b) for a in range(10, 100) for b in range(10, 100)], args.sft + args.rl + args.eval)
    sft, rl, held_out = pairs[:args.sft], pairs[args.sft:args.sft + args.rl], pairs[args.sft + args.rl:]
    tools = tool_schemas()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "tasks_tools_messages_train.jsonl", [transcript(a, b, i % 2 == 0, tools)
                                                           for i, (a, b) in enumerate(sft)])
    write_jsonl(out / "tasks_tools_messages_eval.jsonl", [transcript(a, b, i % 2 == 0, tools)
                                                          for i, (a, b) in enumerate(held_out)])
    write_jsonl(out / "tasks_tools_prompts_train.jsonl", [{"prompt": question(a, b), "answer": str(a + b)}
                                                          for a, b in rl])
    write_jsonl(out / "tasks_tools_prompts_eval.jsonl", [{"prompt": question(a, b), "answer": str(a + b)}
                                                         for a, b in held_out])
    print(f"wrote {len(sft)} SFT transcripts, {len(rl)} GRPO prompts and {len(held_out)} held-out rows to {out}")


if __name__ == "__main__":
    main()
