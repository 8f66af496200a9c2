"""The quickstart: held-out accuracy of the built-in tiny model before and after fine-tuning.

    .venv/bin/python examples/quickstart.py [RECIPE.yaml] [key=value ...]    (what `make train` runs)

1. `toolkit eval` scores the untrained model (the preset's initial weights, built with the
   recipe's seed exactly as training builds them) on the recipe's eval file, which training
   never sees: loss, and answers generated greedily and scored by exact match.
2. `toolkit train` fine-tunes it (overwriting the recipe's output_dir, which belongs to the
   quickstart).
3. `toolkit eval` scores `final/` the same way; the script prints the eval loss and the
   accuracy before and after, per task (a task is a prompt's words but its last, the input).

A recipe whose model.path is the SFT quickstart's result (quickstart_lora.yaml, quickstart_qlora.yaml,
quickstart_grpo.yaml) starts from it, made first when it is missing: the "before" is that model. For
an online-RL recipe (rl.method), besides the greedy answers of `toolkit eval` the script prints the
run's own held-out reward (`eval_reward`: one sampled answer per held-out prompt, scored by the
recipe's reward) at step 0 and at the end. For distillation (rl.method=distill, its teacher the SFT
quickstart's result, made first when it is missing) the student starts from the preset's initial weights
and the script prints its held-out divergence to the teacher (`eval_loss`) at step 0 and at the end, and
the teacher's own accuracy beside the student's.
"""

import contextlib
import importlib.util
import io
import json
import shlex
import sys
import tempfile
from collections import Counter
from pathlib import Path

from toolkit.cli import main as toolkit_main
from toolkit.config import load_recipe
from toolkit.errors import ToolkitError, command


def initial_model(recipe, folder: Path) -> None:
    """The weights `toolkit train` starts from (same seed, same builder), as a model folder."""
    from accelerate.utils import set_seed

    from toolkit.model.load import DTYPES, build_model, build_tokenizer

    set_seed(recipe.seed)
    build_tokenizer(recipe.model).save_pretrained(folder)
    build_model(recipe.model, DTYPES[recipe.model.dtype]).save_pretrained(folder)


def evaluate(model: Path, data: str, max_seq_len: int, out: Path, quiet: bool) -> dict:
    args = ["eval", str(model), "--data", data, "--max-seq-len", str(max_seq_len), "--max-new-tokens", "12",
            "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        code = toolkit_main(args)
    if code != 0:
        sys.exit(code)
    return json.loads(out.read_text())


def per_task(result: dict) -> tuple[Counter, Counter]:
    right, total = Counter(), Counter()
    for r in result["answers"]["records"]:
        task = r["prompt"].rsplit(" ", 1)[0]
        total[task] += 1
        right[task] += r["correct"]
    return right, total


def train_and_score(start: Path, what: str, data: str, recipe, recipe_path: str, overrides: list[str], tmp: Path,
                    quiet: bool):
    """(`toolkit eval` of `start`, of the trained final/) on the held-out `data`, around `toolkit train`;
    or train's exit code when it fails."""
    out = Path(recipe.output_dir)
    print(f"scoring {what} on the held-out prompts ...", flush=True)
    before = evaluate(start, data, recipe.data.max_seq_len, tmp / "before.json", quiet=True)
    (out / "eval.json").unlink(missing_ok=True)  # this script's own file from a run before: overwrite=true
    code = toolkit_main(["train", recipe_path, *overrides])  # replaces only a toolkit run's files
    if code != 0:
        return code
    print(f"\nscoring {out / 'final'} on the same prompts:", flush=True)
    return before, evaluate(out / "final", data, recipe.data.max_seq_len, out / "eval.json", quiet=quiet)


def print_answers(before: dict, after: dict, then: str, now: str, kind: str = "") -> None:
    """Held-out answers right before and after, in all and per task."""
    b, a = before["answers"], after["answers"]
    print(f"held-out {kind}answers right: {b['correct']} of {b['scored']} ({b['accuracy']:.0%}) {then} -> "
          f"{a['correct']} of {a['scored']} ({a['accuracy']:.0%}) {now}")
    (rb, _), (ra, total) = per_task(before), per_task(after)
    width = max(map(len, total))
    for task in sorted(total):
        print(f"  {task:{width}}  {rb[task]:3} -> {ra[task]:3} of {total[task]}")


def ask_yourself(out: Path, prompt: str, chat: bool) -> str:
    """The `toolkit generate` command the quickstart ends with, as it runs from here: `make setup` does
    not activate .venv, so it names .venv/bin/toolkit (`python -m toolkit` failed with the system
    python; tests/test_docs.py's test_the_quickstart_hint_names_the_venv)."""
    return command(f"toolkit generate {shlex.quote(str(out / 'final'))} --prompt {shlex.quote(prompt)}"
                   + ("" if chat else " --no-chat-template"))


def main() -> int:
    args = sys.argv[1:] or ["examples/recipes/quickstart_full.yaml"]
    recipe_path, overrides = args[0], args[1:] + ["overwrite=true"]
    try:
        recipe = load_recipe(recipe_path, overrides)
    except ToolkitError as e:  # one line, as `toolkit train` says it
        print(f"error: {e}", file=sys.stderr)
        return 2
    if recipe.model.preset is None and sft_result_made(Path(recipe.model.path)) != 0:
        return 1
    if recipe.rl.method == "distill":
        if sft_result_made(Path(recipe.rl.teacher), "rl.teacher") != 0:
            return 1
        return distil(recipe, recipe_path, overrides)
    if recipe.rl.method is not None:
        return reinforce(recipe, recipe_path, overrides)
    data, out = str(recipe.data.eval_files[0]), Path(recipe.output_dir)
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        start, what = Path(recipe.model.path or Path(tmp) / "initial"), "the untrained model"
        if recipe.model.preset is None:
            what = f"{start} (the SFT result)"
        else:
            initial_model(recipe, start)
        scored = train_and_score(start, what, data, recipe, recipe_path, overrides, Path(tmp), quiet=False)
    if isinstance(scored, int):
        return scored
    before, after = scored
    print(f"\nheld-out eval loss: {before['loss']:.3f} before training -> {after['loss']:.3f} after")
    print_answers(before, after, "before training" if recipe.model.preset else "before", "after")
    if importlib.util.find_spec("matplotlib") is not None:  # `make setup` installs it; a bare install may not
        toolkit_main(["plot", str(out)])
    records = after["answers"]["records"]
    example = records[0]["prompt"] if records else "..."
    print(f"\nall answers: {out / 'eval.json'}; ask it yourself:\n  "
          + ask_yourself(out, example, chat=recipe.data.format == "messages"))
    return 0


def sft_result_made(start: Path, key: str = "model.path") -> int:
    """The SFT quickstart's result that a LoRA, QLoRA or RL quickstart starts from (or a distillation
    quickstart learns from: `key` rl.teacher), made first when it is missing (0), or the exit code of that run."""
    if (start / "config.json").is_file():
        return 0
    if start != Path("runs/quickstart-full/final"):
        sys.exit(f"examples/quickstart.py: {key} {start} is not a model folder; the quickstart starts from "
                 "a built-in preset or from runs/quickstart-full/final")
    print(f"{start} is missing: running the SFT quickstart first ...", flush=True)
    argv, sys.argv = sys.argv, [sys.argv[0], "examples/recipes/quickstart_full.yaml"]
    try:
        return main()
    finally:
        sys.argv = argv


def reinforce(recipe, recipe_path: str, overrides: list[str]) -> int:
    """Online RL from the SFT quickstart's result: greedy held-out accuracy (toolkit eval on the chat
    twin of the prompt file) and the run's sampled held-out reward, before and after."""
    start, out = Path(recipe.model.path), Path(recipe.output_dir)
    data = str(recipe.data.eval_files[0]).replace("_prompts_", "_messages_")  # the same rows as chats
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        scored = train_and_score(start, f"{start} (the SFT result)", data, recipe, recipe_path, overrides, Path(tmp),
                                 quiet=True)
    if isinstance(scored, int):
        return scored
    before, after = scored
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r for r in rows if r.get("eval_reward") is not None]
    first, last = rewards[0], rewards[-1]
    print(f"\nheld-out reward of sampled answers (temperature {recipe.rl.temperature:g}, the run's eval_reward): "
          f"{first['eval_reward']:.3f} at step 0 -> {last['eval_reward']:.3f} at step {last['step']}")
    print_answers(before, after, "after SFT", "after GRPO", "greedy ")
    if importlib.util.find_spec("matplotlib") is not None:
        toolkit_main(["plot", str(out)])
    return 0


def distil(recipe, recipe_path: str, overrides: list[str]) -> int:
    """Distillation into the preset student: its greedy held-out accuracy before and after, the teacher's, and the
    run's held-out divergence to the teacher (eval_loss) at step 0 and at the end."""
    out = Path(recipe.output_dir)
    data = str(recipe.data.eval_files[0]).replace("_prompts_", "_messages_")  # the same rows as chats
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        start = Path(tmp) / "initial"
        initial_model(recipe, start)
        scored = train_and_score(start, "the untrained student", data, recipe, recipe_path, overrides, Path(tmp),
                                 quiet=True)
        if isinstance(scored, int):
            return scored
        teacher = evaluate(Path(recipe.rl.teacher), data, recipe.data.max_seq_len, Path(tmp) / "teacher.json",
                           quiet=True)
    before, after = scored
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in rows if r.get("eval_loss") is not None]
    print(f"\nheld-out divergence to the teacher per answer token (the run's eval_loss): {losses[0]['eval_loss']:.3f} "
          f"at step 0 -> {losses[-1]['eval_loss']:.3f} at step {losses[-1]['step']}")
    print_answers(before, after, "before", "after distillation", "greedy ")
    t = teacher["answers"]
    print(f"the teacher ({recipe.rl.teacher}): {t['correct']} of {t['scored']} ({t['accuracy']:.0%}) right")
    if importlib.util.find_spec("matplotlib") is not None:
        toolkit_main(["plot", str(out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
