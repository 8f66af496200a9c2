"""End-to-end training through the real CLI: exact accumulation; reloadable outputs (a full model with
transformers, an adapter with peft); safe output folders (a non-empty one refused, overwrite=true
clearing an earlier run); messages with packing and the text format trained end to end; training
from model.path; weight decay on matrices only; gradient checkpointing used and learning the same;
clipping; the quickstart script; objectives that plug into the loop unchanged."""

import json
import math
import os
import random
from pathlib import Path

import pytest
import torch

from toolkit.storage import checkpoint

from helpers import (
    ROOT,
    alpaca_rows,
    base_recipe,
    load_weights,
    read_metrics,
    run_toolkit,
    train_losses,
    train_ok,
    write_jsonl,
    write_recipe,
)

pytestmark = pytest.mark.launch  # every test here starts processes


def train(tmp_path, recipe: dict, name: str, *overrides):
    path = write_recipe(tmp_path / f"{name}.yaml", **recipe)
    proc = run_toolkit("train", path, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_accumulation_is_exact(tmp_path, data_files):
    """micro 2 x accumulation 4 == micro 8 x accumulation 1 (fp32, unequal lengths): same
    losses and same final weights, because the loss is normalised by the global token count."""
    train_f, eval_f = data_files
    a = base_recipe(tmp_path, train_f, eval_f, out="accum", train__micro_batch_size=2,
                    train__gradient_accumulation_steps=4)
    b = base_recipe(tmp_path, train_f, eval_f, out="big", train__micro_batch_size=8,
                    train__gradient_accumulation_steps=1)
    train(tmp_path, a, "a")
    train(tmp_path, b, "b")
    la, lb = train_losses(tmp_path / "accum"), train_losses(tmp_path / "big")
    assert len(la) == len(lb) == 8
    torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-5, atol=0)
    assert la[-1] < la[0]  # it learned something, so equal weights are not trivially equal
    wa, wb = load_weights(tmp_path / "accum" / "final"), load_weights(tmp_path / "big" / "final")
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-5, msg=k)


def eval_loss_with_plain_libraries(model, eval_file, tokenizer_dir, max_seq_len: int = 96,
                                   fmt: str = "alpaca") -> float:
    """Recompute the eval loss from the saved folder, outside the toolkit's training code."""
    from transformers import AutoTokenizer

    from toolkit.config import DataConfig
    from toolkit.data.batching import Collator
    from toolkit.data.formats import IGNORE
    from toolkit.data.prepare import build_datasets

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = build_datasets(DataConfig(train_files=[str(eval_file)], max_seq_len=max_seq_len, format=fmt), tok, 0, False)
    batch = Collator(tok.pad_token_id)(data.train)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(),
                                             ignore_index=IGNORE).item()


def initial_weights(seed: int, preset: str) -> dict:
    """The weights a run of this seed and preset starts from (run() seeds, then builds the model).
    Callers check them against the run's step-0 eval loss or first update, so a change in how
    runs are initialised fails loudly instead of skewing a comparison."""
    from accelerate.utils import set_seed

    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model

    set_seed(seed)
    model = build_model(ModelConfig(preset=preset))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_full_model_reloads_with_transformers(tmp_path, data_files):
    from transformers import AutoModelForCausalLM

    train_f, eval_f = data_files
    train(tmp_path, base_recipe(tmp_path, train_f, eval_f), "full")
    rows = read_metrics(tmp_path / "run")
    last = rows[-1]
    assert {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_second", "eval_loss"} <= last.keys()
    assert rows[0]["step"] == 0 and "eval_loss" in rows[0]
    assert [r["step"] for r in rows] == list(range(9))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final").eval()
    reloaded = eval_loss_with_plain_libraries(model, eval_f, tmp_path / "run" / "final")
    assert reloaded == pytest.approx(last["eval_loss"], rel=1e-5)
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_lora_adapter_reloads_with_peft(tmp_path, data_files):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    train_f, eval_f = data_files
    recipe = base_recipe(tmp_path, train_f, eval_f, lora={"enabled": True, "r": 4, "alpha": 8,
                                                          "target_modules": ["q_proj", "v_proj"]},
                         train__learning_rate=5e-3)
    proc = train(tmp_path, recipe, "lora")
    assert "trainable of" in proc.stdout + proc.stderr
    final = tmp_path / "run" / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "base-model")
    model = PeftModel.from_pretrained(base, final).eval()
    last = read_metrics(tmp_path / "run")[-1]
    assert eval_loss_with_plain_libraries(model, eval_f, final) == pytest.approx(last["eval_loss"], rel=1e-5)
    auto = AutoPeftModelForCausalLM.from_pretrained(final).eval()  # adapter_config points at base-model/
    assert eval_loss_with_plain_libraries(auto, eval_f, final) == pytest.approx(last["eval_loss"], rel=1e-5)
    adapter = load_weights(final)
    assert adapter and all("lora_" in k for k in adapter) and all(v.numel() > 0 for v in adapter.values())


def test_non_empty_output_dir_is_refused_and_untouched(tmp_path, data_files):
    train_f, eval_f = data_files
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("earlier results")
    proc = run_toolkit("train", write_recipe(tmp_path / "r.yaml", **base_recipe(tmp_path, train_f, eval_f)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "output_dir" in proc.stderr and "not empty" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    assert (out / "precious.txt").read_text() == "earlier results"


def test_packing_and_messages_train(tmp_path):
    """The messages format with packing runs end to end on the shipped quickstart data, and does
    pack: no fall-back to padding, fewer rows than examples, full rows of tokens per step."""
    train_file = ROOT / "examples/data/tasks_messages_train.jsonl"
    recipe = {
        "output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-llama-mini"},
        "data": {"train_files": [str(train_file)],
                 "eval_files": [str(ROOT / "examples/data/tasks_messages_eval.jsonl")],
                 "format": "messages", "max_seq_len": 128, "packing": True},
        "train": {"micro_batch_size": 4, "max_steps": 3, "log_every_steps": 1},
    }
    proc = train(tmp_path, recipe, "packed")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4 and all(r.get("loss", 1.0) > 0 for r in rows)
    assert "padding instead of packing" not in proc.stdout + proc.stderr
    # metrics.jsonl's epoch is step / steps_per_epoch, and an epoch is the training rows in
    # global batches of 4 (micro 4 x 1 x 1 process). Measured 2026-11-23: 3,000 examples
    # (36 tokens on average) packed into 1,000 rows (109 on average): 250 steps per epoch.
    examples = sum(1 for line in train_file.read_text().splitlines() if line.strip())
    steps_per_epoch = round(rows[-1]["step"] / rows[-1]["epoch"])
    assert steps_per_epoch * 4 <= examples / 2, (steps_per_epoch, examples)


def test_quickstart_script_scores_before_and_after(tmp_path):
    """`make train`'s script, shortened: scores the untrained model, trains, scores final/. What it
    reports is checked against the run folder: its "before" is the model training started from
    (the eval loss training logged at step 0), its "after" the final/ that training logged last
    and that plain transformers reloads, and the counts are those of eval.json's records."""
    import json
    import os
    import re
    import subprocess
    import sys

    import yaml
    from transformers import AutoModelForCausalLM

    run = tmp_path / "qs"
    # A script's own folder, not the working directory, heads sys.path: without ROOT here the
    # script would import whichever toolkit is installed, not this checkout's.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "examples/quickstart.py", "examples/recipes/quickstart_full.yaml",
                           f"output_dir={run}", "train.max_steps=20", "train.eval_every_steps=0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["train"]["max_steps"] == 20 and config["data"]["packing"] is True
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(21))
    before, after = rows[0]["eval_loss"], rows[-1]["eval_loss"]
    said = re.search(r"held-out eval loss: ([0-9.]+) before training -> ([0-9.]+) after", proc.stdout)
    assert said and (said[1], said[2]) == (f"{before:.3f}", f"{after:.3f}"), proc.stdout[-2000:]
    result = json.loads((run / "eval.json").read_text())
    assert result["loss"] == pytest.approx(after, abs=1e-5)
    answers = result["answers"]
    assert answers["scored"] == len(answers["records"]) == 200
    right = re.search(r"held-out answers right: (\d+) of (\d+) \(\d+%\) before training -> (\d+) of (\d+)",
                      proc.stdout)
    assert right and (int(right[3]), int(right[4])) == (answers["correct"], 200), proc.stdout[-2000:]
    tasks = {r["prompt"].rsplit(" ", 1)[0] for r in answers["records"]}
    for task in tasks:  # one line per task: right before -> right after, of how many
        assert re.search(rf"{re.escape(task)}\s+\d+ ->\s+\d+ of \d+", proc.stdout), (task, proc.stdout[-2000:])
    # Measured 2026-11-23: eval loss 5.635 -> 4.158; mean train loss of steps 1-5 5.45, of 16-20 4.38.
    losses = [r["loss"] for r in rows[1:]]
    assert after < 0.85 * before, (before, after)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    final = run / "final"
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    reloaded = eval_loss_with_plain_libraries(model, ROOT / config["data"]["eval_files"][0], final,
                                              max_seq_len=config["data"]["max_seq_len"], fmt=config["data"]["format"])
    assert reloaded == pytest.approx(after, rel=1e-5)  # measured 1.2e-8 (the run packs its eval rows)
    # The DPO recipe's comment, run as written (shortened): its model.path replaces the recipe's preset.
    dpo = subprocess.run([sys.executable, "-m", "toolkit", "train", "examples/recipes/quickstart_dpo.yaml",
                          f"model.path={final}", f"output_dir={tmp_path / 'dpo'}", "train.max_steps=2",
                          "train.eval_every_steps=0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert dpo.returncode == 0, dpo.stderr[-3000:]
    assert "note: model.path from the command line replaces examples/recipes/quickstart_dpo.yaml's model.preset " \
           "(tiny-llama)" in dpo.stderr, dpo.stderr[-2000:]
    assert yaml.safe_load((tmp_path / "dpo" / "config.yaml").read_text())["model"]["path"] == str(final)


def test_clipping_scales_the_update(tmp_path, data_files):
    """One optimizer step with clipping off and with max_grad_norm well below the gradient's norm:
    the clipped update is the unclipped one times max_grad_norm / grad_norm (the logged, pre-clip
    norm). AdamW's first step is lr * g / (|g| + eps), which ignores the gradient's scale, so the
    recipe sets adam_epsilon far above every gradient element: the step is then plain SGD with
    rate lr / eps, and its size follows the (clipped) gradient."""
    train_f, eval_f = data_files
    lr, eps, max_norm = 100.0, 1e4, 0.5  # SGD rate 1e-2
    runs = {}
    for name, clip in (("off", 0.0), ("clipped", max_norm)):
        recipe = base_recipe(tmp_path, train_f, eval_f, out=name, train__max_steps=1, train__warmup_steps=0,
                             train__learning_rate=lr, train__adam_epsilon=eps, train__max_grad_norm=clip)
        train(tmp_path, recipe, name)
        runs[name] = read_metrics(tmp_path / name)[1]
    start = initial_weights(base_recipe(tmp_path, train_f, eval_f)["seed"], "tiny-llama-mini")
    delta = {}
    for name in runs:
        final = load_weights(tmp_path / name / "final")
        assert final.keys() == start.keys()
        delta[name] = torch.cat([(final[k] - start[k]).flatten() for k in sorted(start)])
    norm = runs["off"]["grad_norm"]
    assert runs["clipped"]["grad_norm"] == norm and runs["off"]["lr"] == runs["clipped"]["lr"] == lr
    assert norm > 4 * max_norm, norm  # clipping is active: measured 2.97 against 0.5
    # Measured 2026-11-23: |delta_off| = lr * norm / eps to 1.3e-5 (relative), |delta_clipped| =
    # lr * max_norm / eps to 7e-6; the clipped delta is the unclipped one times 0.168 element by
    # element to 6.7e-8 (its elements reach 4.8e-4). Unclipped, it would differ by up to 2.4e-3.
    assert delta["off"].norm().item() == pytest.approx(lr * norm / eps, rel=1e-4)
    assert delta["clipped"].norm().item() == pytest.approx(lr * max_norm / eps, rel=1e-4)
    torch.testing.assert_close(delta["clipped"], delta["off"] * (max_norm / norm), rtol=0, atol=1e-6)


def test_another_objective_plugs_in_without_touching_the_loop(tmp_path, data_files):
    """tests/objective_driver.py swaps in an objective whose loss is twice the supervised one; the
    loop, unchanged, must report exactly twice the eval loss before training and twice the first
    step's loss (both come from the same initial weights and the same batch)."""
    import subprocess
    import sys

    train_f, eval_f = data_files
    plain = write_recipe(tmp_path / "plain.yaml", **base_recipe(tmp_path, train_f, eval_f, out="plain",
                                                               train__max_steps=1, train__warmup_steps=0))
    doubled = write_recipe(tmp_path / "doubled.yaml", **base_recipe(tmp_path, train_f, eval_f, out="doubled",
                                                                   train__max_steps=1, train__warmup_steps=0))
    assert run_toolkit("train", plain).returncode == 0
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "objective_driver.py"), str(doubled)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "doubled")
    assert a[0]["step"] == b[0]["step"] == 0 and b[0]["eval_loss"] == 2 * a[0]["eval_loss"]
    assert a[1]["step"] == b[1]["step"] == 1 and b[1]["loss"] == 2 * a[1]["loss"]


def test_an_objective_that_makes_its_own_batch_plugs_in(tmp_path, data_files):
    """tests/objective_driver.py --remade: an objective written against `objectives.Objective` alone
    makes each step's batch itself (every row of the loader's twice over, through `step_batches`,
    the seam online RL uses for its sampled completions). The loop, unchanged, must count what was
    made (twice the tokens) and take the loss on it: a mean over units that is the plain run's."""
    import subprocess
    import sys

    train_f, eval_f = data_files
    plain = write_recipe(tmp_path / "plain.yaml", **base_recipe(tmp_path, train_f, eval_f, out="plain",
                                                               train__max_steps=1, train__warmup_steps=0))
    remade = write_recipe(tmp_path / "remade.yaml", **base_recipe(tmp_path, train_f, eval_f, out="remade",
                                                                 train__max_steps=1, train__warmup_steps=0))
    assert run_toolkit("train", plain).returncode == 0
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "objective_driver.py"), "--remade", str(remade)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "remade")
    assert b[1]["tokens"] == 2 * a[1]["tokens"]
    assert b[1]["loss"] == pytest.approx(a[1]["loss"], rel=1e-5)


# ---------------------------------------------------------- overwrite, text format, model.path (own data)
# These runs use this module's own data (`work`) and `train_in`, which trains a recipe written there.
# Gradient checkpointing is observed through a `sitecustomize.py` put on the run's PYTHONPATH that
# wraps torch's `checkpoint` function (still calling it) and counts its calls; nothing is replaced.

TRAIN_ROWS = 44  # global batch 4 x 2 = 8: floor(44 / 8) = 5 steps per epoch, 4 rows left over
PRESET = json.loads((ROOT / "toolkit" / "model" / "presets" / "tiny-llama-mini.json").read_text())


def text_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 10)))
        rows.append({"text": f"{word} backwards is {word[::-1]}."})
    return rows


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_options")
    write_jsonl(d / "train.jsonl", alpaca_rows(TRAIN_ROWS, seed=11))
    write_jsonl(d / "eval.jsonl", alpaca_rows(8, seed=12))
    write_jsonl(d / "text_train.jsonl", text_rows(48, seed=13))
    write_jsonl(d / "text_eval.jsonl", text_rows(8, seed=14))
    return d


def recipe(work: Path, out: str, **overrides) -> dict:
    """helpers' base recipe (tiny-llama-mini, micro 4 x accumulation 2, fp32) on this module's data."""
    return base_recipe(work, work / "train.jsonl", work / "eval.jsonl", out=out, **overrides)


train_in = train_ok


def test_overwrite_clears_an_earlier_run_and_trains(work):
    """(Without overwrite=true the folder is refused: test_non_empty_output_dir_is_refused_and_untouched
    above; a folder that is not a run is never cleared: tests/test_run_folder.py.)"""
    out = work / "overwritten"
    (out / "checkpoints" / "step-000099").mkdir(parents=True)
    (out / "checkpoints" / "step-000099" / checkpoint.MARKER).write_text("step 99\n")
    (out / "config.yaml").write_text("output_dir: earlier\n")
    (out / "final").mkdir()
    (out / "final" / "old.txt").write_text("earlier results")
    write_jsonl(out / "metrics.jsonl", [{"step": 99, "loss": 1.0}])
    train_in(work, "overwrite", recipe(work, "overwritten", overwrite=True, train__max_steps=1, train__warmup_steps=0))
    assert not (out / "final" / "old.txt").exists() and not (out / "checkpoints").exists()
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    assert (out / "final" / "model.safetensors").is_file()


def test_dft_trains_end_to_end(work):
    """train.loss_type=dft (TRL's SFT loss_type dft; tests/test_dpo_losses.py compares it with TRL's): each token's
    loss is p x -log p, at most 1/e, so the logged loss and eval loss (the same loss, as TRL's) are too."""
    proc = train_in(work, "dft", recipe(work, "dft", train__loss_type="dft", train__max_steps=2,
                                        train__log_every_steps=1))
    assert "loss: dft (Dynamic Fine-Tuning)" in proc.stdout + proc.stderr
    rows = read_metrics(work / "dft")
    values = [r[k] for r in rows for k in ("loss", "eval_loss") if k in r]
    assert len(values) >= 4 and all(0 < v <= 1 / math.e for v in values), rows


def text_recipe(work: Path, out: str, train_file: str, eval_file: str, **overrides) -> dict:
    sections = recipe(work, out, **overrides)
    sections["data"] = {"train_files": [str(work / train_file)], "eval_files": [str(work / eval_file)],
                        "format": "text", "max_seq_len": 96}
    return sections


def plain_text_loss(folder: Path, rows: list[dict]) -> float:
    """Token-weighted loss of a saved folder on text rows, with plain transformers: BOS + text + EOS,
    every token after the first a target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    total, count = 0.0, 0
    for row in rows:
        ids = torch.tensor([[tok.bos_token_id] + tok(row["text"], add_special_tokens=False)["input_ids"]
                            + [tok.eos_token_id]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        total += torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


@pytest.fixture(scope="module")
def text_run(work):
    train_in(work, "text", text_recipe(work, "text", "text_train.jsonl", "text_eval.jsonl", train__max_steps=12,
                                       train__learning_rate=3e-3))
    return work / "text"


def test_text_format_trains_end_to_end(work, text_run):
    rows = read_metrics(text_run)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 12 and losses[-1] < 0.9 * losses[0], losses
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    eval_rows = [json.loads(line) for line in (work / "text_eval.jsonl").read_text().splitlines()]
    assert plain_text_loss(text_run / "final", eval_rows) == pytest.approx(rows[-1]["eval_loss"], rel=1e-5)


def test_training_from_model_path(work, text_run):
    """model.path = the text run's final/ folder. Its 8 eval rows are exactly one global batch here,
    so the first training loss and the step-0 eval loss are both the loss of those weights on them."""
    source = text_run / "final"
    sections = text_recipe(work, "from_path", "text_eval.jsonl", "text_eval.jsonl", train__max_steps=3,
                           train__warmup_steps=0, model={"path": str(source)})
    train_in(work, "from_path", sections)
    rows = read_metrics(work / "from_path")
    eval_rows = [json.loads(line) for line in (work / "text_eval.jsonl").read_text().splitlines()]
    same_weights = plain_text_loss(source, eval_rows)
    assert rows[0]["eval_loss"] == pytest.approx(same_weights, rel=1e-5)
    assert rows[1]["loss"] == pytest.approx(same_weights, rel=1e-5)
    assert rows[0]["eval_loss"] == pytest.approx(read_metrics(text_run)[-1]["eval_loss"], rel=1e-5)
    assert rows[-1]["loss"] < rows[1]["loss"]  # and it trained from there
    before, after = load_weights(source), load_weights(work / "from_path" / "final")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------- weight decay groups

DECAY_LR, DECAY = 1e-3, 5.0


@pytest.fixture(scope="module")
def decay_runs(work):
    """One optimizer step (lr = learning_rate, no warmup) with weight_decay 0 and 5; everything else equal."""
    out = {}
    for wd in (0.0, DECAY):
        name = f"decay_{wd:g}"
        train_in(work, name, recipe(work, name, train__max_steps=1, train__warmup_steps=0,
                                    train__learning_rate=DECAY_LR, train__weight_decay=wd))
        out[wd] = load_weights(work / name / "final")
    return out


def test_weight_decay_reaches_matrices_only(decay_runs):
    """Same first gradient in both runs, so AdamW's decoupled decay is the only difference:
    norm weights (1-D) identical; every matrix decayed by exactly learning_rate x weight_decay
    times its initial value p0, i.e. p(wd=0) - p(wd) = lr * wd * p0. With the Adam update of a
    first step at most lr per element, p0 recovered this way lies within lr of p(wd=0)."""
    plain, decayed = decay_runs[0.0], decay_runs[DECAY]
    assert plain.keys() == decayed.keys()
    vectors = [k for k, v in plain.items() if v.ndim < 2]
    matrices = [k for k, v in plain.items() if v.ndim >= 2]
    assert vectors and all("norm" in k for k in vectors) and len(matrices) > len(vectors)
    for k in vectors:
        assert torch.equal(plain[k], decayed[k]), f"{k} (1-D) was decayed"
    for k in matrices:
        assert not torch.equal(plain[k], decayed[k]), f"{k} (a matrix) was not decayed"
        initial = (plain[k] - decayed[k]) / (DECAY_LR * DECAY)
        moved = (plain[k] - initial).abs().max().item()
        assert moved <= DECAY_LR * 1.05, f"{k}: decay is not lr * weight_decay * p ({moved:.2e} > lr)"


# ----------------------------------------------------------------------------- gradient checkpointing

# Loaded by every Python started with this folder on PYTHONPATH: wraps (and calls) torch's
# checkpoint function, which transformers binds when imported, and counts its calls.
COUNTING_CHECKPOINT = '''
import atexit, os
import torch.utils.checkpoint as _cp
_real, _calls = _cp.checkpoint, [0]
def checkpoint(*args, **kwargs):
    _calls[0] += 1
    return _real(*args, **kwargs)
_cp.checkpoint = checkpoint
atexit.register(lambda: open(os.environ["CHECKPOINT_CALLS_FILE"], "w").write(str(_calls[0])))
'''
GC_STEPS = 6


@pytest.fixture(scope="module")
def checkpointing_runs(work):
    """LoRA with dropout (so the recomputed forward must redraw the same dropout masks), with and
    without model.gradient_checkpointing; each counts the layer forwards that went through torch's
    checkpoint."""
    spy = work / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(COUNTING_CHECKPOINT)
    out = {}
    for enabled in (False, True):
        name = f"gc_{str(enabled).lower()}"
        calls = work / f"{name}.calls"
        env = {"PYTHONPATH": os.pathsep.join([str(spy)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               "CHECKPOINT_CALLS_FILE": str(calls)}
        train_in(work, name, recipe(work, name, lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1},
                                    model={"preset": "tiny-llama-mini", "gradient_checkpointing": enabled},
                                    train__max_steps=GC_STEPS, train__warmup_steps=1, train__learning_rate=5e-3),
                 env=env)
        out[enabled] = {"rows": read_metrics(work / name), "calls": int(calls.read_text()),
                        "adapter": load_weights(work / name / "final")}
    return out


def test_gradient_checkpointing_is_used_and_learns_the_same(checkpointing_runs):
    off, on = checkpointing_runs[False], checkpointing_runs[True]
    # Every decoder layer, every training micro-batch (2 per step), went through checkpoint; eval did not.
    # So did train.loss=chunked's one chunk per training micro-batch (fewer than 1,024 targets), in both.
    assert off["calls"] == 2 * GC_STEPS
    assert on["calls"] == (PRESET["num_hidden_layers"] + 1) * 2 * GC_STEPS
    for key in ("loss", "grad_norm", "eval_loss"):
        a = [r[key] for r in off["rows"] if key in r]
        b = [r[key] for r in on["rows"] if key in r]
        assert len(a) == len(b) > 1
        assert b == pytest.approx(a, rel=1e-5), key
    assert off["rows"][-1]["loss"] < off["rows"][1]["loss"]
    assert off["adapter"].keys() == on["adapter"].keys() and off["adapter"]
    for k, v in off["adapter"].items():
        torch.testing.assert_close(on["adapter"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in on["adapter"].items())  # it trained
