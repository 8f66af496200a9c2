"""README promises that had no test of their own, each checked as the README states it.

Every run is a real launch (`python -m toolkit train`, or `accelerate launch` with
accelerate_configs/ddp.yaml where 2 processes are needed). Runs are module fixtures so one run
gives the facts for several tests: `main_run` (epochs=2, warmup, min_lr_ratio, checkpoints every
3 steps, keep_last 3) serves epochs, cosine, keep_last, the manifest, resume by path and both
refusals. Of these promises only one half was tested before: a non-empty output_dir refused
without overwrite (tests/test_train.py::test_non_empty_output_dir_is_refused_and_untouched).

Gradient checkpointing is observed through a `sitecustomize.py` put on the run's PYTHONPATH that
wraps torch's `checkpoint` function (still calling it) and counts its calls; nothing is replaced.
"""

import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (ROOT, alpaca_rows, base_recipe, finish, load_weights, read_metrics, read_output, run_toolkit,
                      start, user_error_line, write_jsonl, write_recipe)
from toolkit.storage import checkpoint

pytestmark = pytest.mark.launch  # every test here starts processes

TRAIN_ROWS = 44  # global batch 4 x 2 = 8: floor(44 / 8) = 5 steps per epoch, 4 rows left over
PRESET = json.loads((ROOT / "toolkit" / "model" / "presets" / "tiny-llama-mini.json").read_text())


# ----------------------------------------------------------------------------- helpers


def text_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 10)))
        rows.append({"text": f"{word} backwards is {word[::-1]}."})
    return rows


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("promises")
    write_jsonl(d / "train.jsonl", alpaca_rows(TRAIN_ROWS, seed=11))
    write_jsonl(d / "eval.jsonl", alpaca_rows(8, seed=12))
    write_jsonl(d / "text_train.jsonl", text_rows(48, seed=13))
    write_jsonl(d / "text_eval.jsonl", text_rows(8, seed=14))
    return d


def recipe(work: Path, out: str, **overrides) -> dict:
    """helpers' base recipe (tiny-llama-mini, micro 4 x accumulation 2, fp32) on this module's data."""
    return base_recipe(work, work / "train.jsonl", work / "eval.jsonl", out=out, **overrides)


def train(work: Path, name: str, sections: dict, *overrides, env=None) -> subprocess.CompletedProcess:
    proc = run_toolkit("train", write_recipe(work / f"{name}.yaml", **sections), *overrides, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def snapshot(root: Path) -> dict:
    """Every file under root: content hash and modification time."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def comparable(rows: list[dict]) -> list[dict]:
    from toolkit.observe.measure import MEASURED

    return [{k: v for k, v in r.items() if k not in MEASURED} for r in rows]


# ----------------------------------------------------------------------------- the main run

MAIN = dict(train__max_steps=None, train__epochs=2, train__warmup_steps=3, train__min_lr_ratio=0.1,
            train__learning_rate=2e-3, train__log_every_steps=1, checkpoint={"every_steps": 3, "keep_last": 3})


@pytest.fixture(scope="module")
def main_run(work):
    """Uninterrupted, no max_steps: 2 epochs of 5 steps; checkpoints at 3, 6, 9 and 10 (the end)."""
    train(work, "main", recipe(work, "main", **MAIN))
    return work / "main"


def test_epochs_without_max_steps(main_run):
    """steps = epochs x floor(rows / global batch); the epoch column reaches `epochs`."""
    rows = read_metrics(main_run)
    steps_per_epoch = TRAIN_ROWS // (4 * 2)
    assert [r["step"] for r in rows] == list(range(2 * steps_per_epoch + 1))
    assert [r["epoch"] for r in rows] == [round(s / steps_per_epoch, 4) for s in range(2 * steps_per_epoch + 1)]
    assert rows[-1]["epoch"] == 2.0 and rows[steps_per_epoch]["epoch"] == 1.0


def test_warmup_then_cosine_to_min_lr_ratio(main_run):
    """Each step's logged lr is linear warmup (3 steps) then cosine decay from learning_rate to
    learning_rate x min_lr_ratio over the run; the schedule ends exactly at the minimum."""
    lr, warmup, ratio = 2e-3, 3, 0.1
    rows = [r for r in read_metrics(main_run) if r["step"] > 0]
    total = len(rows)
    expected = []
    for step in range(1, total + 1):
        if step <= warmup:
            expected.append(lr * step / warmup)
        else:
            progress = (step - 1 - warmup) / (total - warmup)
            expected.append(lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress))))
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-9, abs=0)
    assert max(r["lr"] for r in rows) == pytest.approx(lr, rel=1e-12)
    # After the last step the scheduler stands at learning_rate x min_lr_ratio (saved with the final checkpoint).
    scheduler = torch.load(main_run / "checkpoints" / f"step-{total:06d}" / "scheduler.bin", weights_only=False)
    assert scheduler["_last_lr"] == pytest.approx([lr * ratio] * len(scheduler["_last_lr"]), rel=1e-9)


def test_keep_last_keeps_the_newest_complete_checkpoints(main_run):
    """Checkpoints were written at steps 3, 6, 9 and 10; keep_last=3 leaves the newest three, all complete."""
    names = sorted(p.name for p in (main_run / "checkpoints").iterdir())
    assert names == ["step-000006", "step-000009", "step-000010"], names
    assert all(checkpoint.is_complete(main_run / "checkpoints" / n) for n in names)


@pytest.fixture(scope="module")
def by_path(work, main_run):
    """resume=<a checkpoint of main_run> into a new, empty output_dir."""
    before = snapshot(main_run)
    source = main_run / "checkpoints" / "step-000006"
    proc = run_toolkit("train", work / "main.yaml", f"output_dir={work / 'by_path'}", f"resume={source}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert snapshot(main_run) == before, "resuming from main_run's checkpoint changed main_run"
    return work / "by_path", source, proc


def test_resume_by_path_continues_identically(main_run, by_path):
    run, source, proc = by_path
    assert f"resumed from {source} at step 6" in proc.stdout
    resumed = read_metrics(run)
    assert [r["step"] for r in resumed] == [7, 8, 9, 10]
    assert comparable(resumed) == comparable(read_metrics(main_run)[7:])
    want, have = load_weights(main_run / "final"), load_weights(run / "final")
    assert want and want.keys() == have.keys()
    for k in want:
        assert torch.equal(want[k], have[k]), f"{k} differs"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000009", "step-000010"]


# ----------------------------------------------------------------------------- manifest

def test_manifest_records_recipe_versions_launch(main_run, by_path, preempted):
    import accelerate
    import transformers
    import yaml

    from toolkit.config import load_recipe

    m = json.loads((main_run / "manifest.json").read_text())
    resolved = load_recipe(main_run.with_suffix(".yaml")).to_dict()
    assert m["recipe"] == resolved == yaml.safe_load((main_run / "config.yaml").read_text())
    assert m["recipe"]["train"]["adam_beta2"] == 0.999 and m["recipe"]["train"]["max_steps"] is None  # defaults filled
    assert m["world_size"] == 1 and m["global_batch_size"] == 8
    saved = checkpoint.read_state(main_run / "checkpoints" / "step-000010")
    assert m["dataset_fingerprint"] == saved.data_fingerprint and len(saved.data_fingerprint) == 16
    assert len(m["launches"]) == 1
    launch = m["launches"][0]
    assert launch["resumed_from"] is None and launch["world_size"] == 1 and launch["launch"] == "single"
    assert str(main_run.with_suffix(".yaml")) in launch["command"]
    assert launch["deepspeed_config"] is None
    assert launch["versions"]["torch"] == torch.__version__
    assert launch["versions"]["transformers"] == transformers.__version__
    assert launch["versions"]["accelerate"] == accelerate.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert launch["git_commit"] == head and len(head) == 40
    # Resume by path into a new folder: one launch, resumed from the given checkpoint.
    run, source, _ = by_path
    launches = json.loads((run / "manifest.json").read_text())["launches"]
    assert [entry["resumed_from"] for entry in launches] == [str(source)]
    # Two launches into one folder (the SIGINT run, then its resume): one entry each.
    launches = json.loads((preempted["run"] / "manifest.json").read_text())["launches"]
    assert [entry["resumed_from"] for entry in launches] == [None, str(preempted["checkpoint"])]
    assert "resume=auto" not in launches[0]["command"] and "resume=auto" in launches[1]["command"]


# ----------------------------------------------------------------------------- refusals


def test_resume_under_another_process_count_and_global_batch_is_refused(work, main_run):
    """A 1-process checkpoint resumed by 2 DDP processes with the same micro-batch, so twice the
    global batch: the toolkit's one line naming both values (worker exit code 2, as torchrun
    reports it), no traceback of the toolkit's, the run folder untouched. (With the same global
    batch it continues: tests/test_portable_resume.py.)"""
    before = snapshot(main_run)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--main_process_port", "0", "-m"]
    proc = run_toolkit("train", work / "main.yaml", "resume=auto", launcher=launcher, timeout=600)
    error = user_error_line(proc, launched=True)
    assert error.startswith(f"error: resume: {main_run / 'checkpoints' / 'step-000010'} was trained with a global "
                            "batch of 8 sequences and this launch makes 16"), error
    assert snapshot(main_run) == before


def test_resume_with_changed_data_is_refused(work, main_run):
    """Same recipe, same file name, other contents: one line, exit 2, nothing in the run folder changed."""
    data = work / "train.jsonl"
    original = data.read_bytes()
    before = snapshot(main_run)
    try:
        write_jsonl(data, alpaca_rows(TRAIN_ROWS, seed=99))  # as many rows: the same number of steps
        proc = run_toolkit("train", work / "main.yaml", "resume=auto")
    finally:
        data.write_bytes(original)
    error = user_error_line(proc)
    assert error.startswith(f"error: resume: the training data changed since "
                            f"{main_run / 'checkpoints' / 'step-000010'} was written (fingerprint "), error
    assert snapshot(main_run) == before


# ----------------------------------------------------------------------------- second SIGINT

SIGINT_STEPS = 5000  # far more than run before the signals (a step takes ~20 ms here)


def wait_until(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"run ended early (exit {proc.returncode}): {read_output(proc)[1][-3000:]}")
        time.sleep(0.01)
    raise AssertionError("never reached")


def last_logged_step(run: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run)), default=-1)
    except (FileNotFoundError, json.JSONDecodeError):  # a row being written
        return -1


def checkpoint_being_written(run: Path, after_step: int):
    folder = run / "checkpoints"
    found = [p for p in folder.glob(".tmp-step-*") if int(p.name[-6:]) > after_step] if folder.is_dir() else []
    return found[0] if found else None


def interrupt(proc) -> bool:
    """SIGINT to a run that is still going; False when it had already ended."""
    if proc.poll() is not None:
        return False
    try:
        os.kill(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def preempted(work):
    """Launch 1: SIGINT, and again as soon as the checkpoint is being written (slowed to 3 s by
    the test seam), well within 2 s: one request, so a checkpoint and exit 75. Launch 2
    (resume=auto): SIGINT, then a second one 3 s later, while the checkpoint write (slowed to 10 s)
    is still going on. Only facts are gathered here; the tests judge them."""
    sections = recipe(work, "sigint", train__max_steps=SIGINT_STEPS, train__log_every_steps=1000,
                      checkpoint={"every_steps": 0, "keep_last": 2})
    path = write_recipe(work / "sigint.yaml", **sections)
    run = work / "sigint"
    command = [sys.executable, "-m", "toolkit", "train", str(path)]

    proc = start(command, env={"TOOLKIT_FAULT_CHECKPOINT_PAUSE": "3"})
    wait_until(lambda: last_logged_step(run) >= 2, proc)  # training, so the signal handler is installed
    interrupt(proc)
    first_at = time.monotonic()
    writing = wait_until(lambda: checkpoint_being_written(run, 0), proc)
    gap = time.monotonic() - first_at
    still_writing = not (writing / checkpoint.MARKER).exists()
    repeated = interrupt(proc)
    rc, out, err = finish(proc, timeout=300)
    one = {"rc": rc, "out": out, "err": err, "gap": gap, "still_writing": still_writing and repeated,
           "checkpoints": checkpoint.complete_checkpoints(run)}

    logged = last_logged_step(run)
    proc = start(command + ["resume=auto"], env={"TOOLKIT_FAULT_CHECKPOINT_PAUSE": "10"})
    wait_until(lambda: last_logged_step(run) >= logged + 2, proc)  # rows written by this launch
    interrupt(proc)
    first_at = time.monotonic()
    writing = wait_until(lambda: checkpoint_being_written(run, logged), proc)
    time.sleep(max(0.0, first_at + 3.0 - time.monotonic()))
    still_writing = not (writing / checkpoint.MARKER).exists()
    repeated = interrupt(proc)
    second_at = time.monotonic()
    proc.wait(timeout=300)
    out, err = read_output(proc)
    two = {"rc": proc.returncode, "out": out, "err": err, "exit_after": time.monotonic() - second_at,
           "signal_gap": second_at - first_at, "still_writing": still_writing and repeated, "writing": writing}
    return {"run": run, "first": one, "second": two,
            "checkpoint": one["checkpoints"][-1] if one["checkpoints"] else None}


def test_sigint_checkpoints_and_a_repeat_within_2s_is_the_same_request(preempted):
    first = preempted["first"]
    assert first["still_writing"] and first["gap"] < 1.5, first["gap"]  # the repeat came mid-write, < 2 s after
    assert first["rc"] == 75, first["err"][-3000:]
    last = first["err"].strip().splitlines()[-1]
    assert last.startswith("stopped: preempted: checkpoint") and "resume=auto" in last, last
    assert "Traceback" not in first["err"]
    said = first["out"] + first["err"]
    assert said.count("stopping after this optimizer step") == 1, said[-3000:]  # the repeat said nothing
    assert len(first["checkpoints"]) == 1 and preempted["checkpoint"] == first["checkpoints"][0]
    assert not (preempted["run"] / "final").exists()


def test_second_sigint_after_2s_aborts_at_once(preempted):
    """Exit 130 (128 + SIGINT) within a second of the second signal, though the checkpoint write
    had 7 s to go; the write it abandoned is never taken for a checkpoint, the earlier one is intact."""
    second = preempted["second"]
    assert second["still_writing"] and second["signal_gap"] > 2.0
    assert second["rc"] == 128 + signal.SIGINT, second["err"][-3000:]
    assert second["exit_after"] < 1.5, second["exit_after"]
    assert "resumed from" in second["out"]
    run = preempted["run"]
    assert second["writing"].is_dir() and not (second["writing"] / checkpoint.MARKER).exists()
    assert checkpoint.complete_checkpoints(run) == [preempted["checkpoint"]]
    assert not (run / "final").exists()


# ----------------------------------------------------------------------------- output_dir, model.path, text


def test_overwrite_clears_an_earlier_run_and_trains(work):
    """(Without overwrite=true the folder is refused: tests/test_train.py::test_non_empty_output_dir_is_refused_and_untouched;
    a folder that is not a run is never cleared: tests/test_first_hour.py.)"""
    out = work / "overwritten"
    (out / "checkpoints" / "step-000099").mkdir(parents=True)
    (out / "checkpoints" / "step-000099" / checkpoint.MARKER).write_text("step 99\n")
    (out / "config.yaml").write_text("output_dir: earlier\n")
    (out / "final").mkdir()
    (out / "final" / "old.txt").write_text("earlier results")
    write_jsonl(out / "metrics.jsonl", [{"step": 99, "loss": 1.0}])
    train(work, "overwrite", recipe(work, "overwritten", overwrite=True, train__max_steps=1, train__warmup_steps=0))
    assert not (out / "final" / "old.txt").exists() and not (out / "checkpoints").exists()
    assert [r["step"] for r in read_metrics(out)] == [0, 1]
    assert (out / "final" / "model.safetensors").is_file()


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
    train(work, "text", text_recipe(work, "text", "text_train.jsonl", "text_eval.jsonl", train__max_steps=12,
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
    train(work, "from_path", sections)
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
        train(work, name, recipe(work, name, train__max_steps=1, train__warmup_steps=0,
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
        train(work, name, recipe(work, name, lora={"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1},
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
