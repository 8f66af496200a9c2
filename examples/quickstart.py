"""The quickstart: fine-tune the built-in tiny model, then ask it held-out questions.

    python examples/quickstart.py [RECIPE.yaml] [key=value ...]    (what `make train` runs)

Trains with `toolkit train` (overwriting the recipe's output_dir, which belongs to the
quickstart), prints how the eval loss fell, then reloads `final/` with plain transformers (or
peft, for an adapter) and answers a few prompts from the eval file, which training never saw.
"""

import json
import sys
from pathlib import Path

import torch

from toolkit.cli import main as toolkit_main
from toolkit.config import load_recipe
from toolkit.data import ALPACA_PROMPT_WITH_INPUT


def load_final(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if (folder / "adapter_config.json").exists():
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(folder).eval(), tokenizer
    return AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer


def prompt_for(row: dict, fmt: str, tokenizer) -> tuple[str, str]:
    if fmt == "messages":
        turns = row["messages"]
        return (tokenizer.apply_chat_template(turns[:-1], tokenize=False, add_generation_prompt=True),
                turns[-1]["content"])
    return (tokenizer.bos_token + ALPACA_PROMPT_WITH_INPUT.format(**row), row["output"])


def main() -> int:
    args = sys.argv[1:] or ["examples/recipes/quickstart_full.yaml"]
    recipe_path, overrides = args[0], args[1:] + ["overwrite=true"]
    code = toolkit_main(["train", recipe_path, *overrides])
    if code != 0:
        return code
    recipe = load_recipe(recipe_path, overrides)
    out = Path(recipe.output_dir)
    evals = [r["eval_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r.get("eval_loss") is not None]
    print(f"\neval loss: {evals[0]:.3f} before training -> {evals[-1]:.3f} after "
          f"({evals[-1] / evals[0]:.0%} of the first)")

    model, tokenizer = load_final(out / "final")
    rows = [json.loads(line) for line in Path(recipe.data.eval_files[0]).read_text().splitlines()[:4]]
    print(f"\nheld-out prompts, answered by {out / 'final'}:")
    for row in rows:
        prompt, expected = prompt_for(row, recipe.data.format, tokenizer)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        question = prompt.split("Instruction:\n")[-1].split("<|user|>\n")[-1].split("\n")[0:4]
        question = " ".join(q for q in question if q and not q.startswith("###"))
        mark = "ok" if answer == expected else f"expected {expected}"
        print(f"  {question!r:45} -> {answer!r}  ({mark})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
