"""A run's checkpoints across its launches (toolkit/storage/checkpoint.py, and the resume choices of
toolkit/storage/run_folder.py), on real launches: which checkpoints are kept (keep_last), what the
manifest records for each launch, resume by path (into an empty folder it continues identically;
into another run, or from a checkpoint that is not the newest, it is refused), the resumes refused
under another process count and global batch or with changed data, saves that a kill interrupted
finished or removed on resume, and SIGINT: a checkpoint and exit 75, a repeat within 2 s the same
request, a second one later an abort at once.

Every run is a real launch (`python -m toolkit train`, or `accelerate launch` with
accelerate_configs/ddp.yaml where 2 processes are needed). Runs are module fixtures so one run
gives the facts for several tests: `main_run` (epochs=2, warmup, min_lr_ratio, checkpoints every
3 steps, keep_last 3) serves keep_last, the manifest, resume by path and both refusals, and with
them the schedule of a run without max_steps (epochs, warmup then cosine to min_lr_ratio), which
would otherwise need a run of its own; `preempted` (two interrupted launches into one folder)
serves SIGINT and the manifest's launches; `finished_run` (checkpoints at steps 2 and 4) serves
resume by path into another run and the interrupted saves.
"""

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from toolkit.storage import checkpoint

from helpers import (
    ROOT,
    alpaca_rows,
    base_recipe,
    finish,
    load_weights,
    read_metrics,
    read_output,
    run_toolkit,
    start,
    train_ok,
    user_error_line,
    write_jsonl,
    write_recipe,
)

pytestmark = pytest.mark.launch  # every test here starts processes

TRAIN_ROWS = 44  # global batch 4 x 2 = 8: floor(44 / 8) = 5 steps per epoch, 4 rows left over


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("checkpoints")
    write_jsonl(d / "train.jsonl", alpaca_rows(TRAIN_ROWS, seed=11))
    write_jsonl(d / "eval.jsonl", alpaca_rows(8, seed=12))
    return d


def recipe(work: Path, out: str, **overrides) -> dict:
    """helpers' base recipe (tiny-llama-mini, micro 4 x accumulation 2, fp32) on this module's data."""
    return base_recipe(work, work / "train.jsonl", work / "eval.jsonl", out=out, **overrides)


train = train_ok


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


# ----------------------------------------------------------------------------- resume by path

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


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished single-process run with checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("finished_run")
    train = write_jsonl(d / "train.jsonl", alpaca_rows(32, seed=1))
    evaluation = write_jsonl(d / "eval.jsonl", alpaca_rows(4, seed=2))
    recipe = base_recipe(d, train, evaluation, out="a", train__max_steps=4, train__micro_batch_size=2,
                         checkpoint={"every_steps": 2, "keep_last": 5})
    proc = run_toolkit("train", write_recipe(d / "a.yaml", **recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d, recipe


def test_resume_by_path_never_writes_into_another_run(finished_run):
    d, recipe = finished_run
    step2 = d / "a" / "checkpoints" / "step-000002"
    other = d / "b"
    shutil.copytree(d / "a", other)  # someone's earlier results
    before_a, before_b = snapshot(d / "a"), snapshot(other)

    error = user_error_line(run_toolkit("train", write_recipe(d / "into_b.yaml",
                                                              **{**recipe, "output_dir": str(other)}),
                                       f"resume={step2}"))
    assert "b is not empty and resume=" in error and "is a checkpoint of another run" in error, error
    error = user_error_line(run_toolkit("train", d / "a.yaml", f"resume={step2}"))
    assert "is not the newest checkpoint" in error and "step-000004 is" in error, error
    assert snapshot(d / "a") == before_a and snapshot(other) == before_b

    # Into an empty folder it is a new run that continues from that checkpoint, as the first one did.
    proc = run_toolkit("train", d / "a.yaml", f"resume={step2}", f"output_dir={d / 'c'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {r["step"]: r["loss"] for r in read_metrics(d / "a") if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in read_metrics(d / "c") if "loss" in r}
    assert resumed == {3: steps[3], 4: steps[4]}
    a, c = load_weights(d / "a" / "final"), load_weights(d / "c" / "final")
    assert a.keys() == c.keys() and all(a[k].equal(c[k]) for k in a)


def test_interrupted_saves_are_finished_or_removed_on_resume(finished_run):
    """The states a kill can leave inside checkpoint.save / replace_dir / save_model."""
    d, recipe = finished_run
    run = d / "killed"
    shutil.copytree(d / "a", run)
    cks = run / "checkpoints"
    (cks / "step-000004").rename(cks / ".tmp-step-000004")  # complete, killed before its rename
    shutil.copytree(cks / "step-000002", cks / ".tmp-step-000006")
    (cks / ".tmp-step-000006" / checkpoint.MARKER).unlink()  # killed mid-write
    shutil.copytree(cks / "step-000002", cks / ".del-step-000001")  # killed while pruning
    (run / "final").rename(run / ".del-final")  # killed between the two renames of replace_dir
    shutil.copytree(run / ".del-final", run / "final.tmp")
    proc = run_toolkit("train", write_recipe(d / "killed.yaml", **{**recipe, "output_dir": str(run)}), "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoints: completed step-000004" in proc.stdout, proc.stdout[-2000:]
    assert "resumed from" in proc.stdout and "step-000004 at step 4" in proc.stdout, proc.stdout[-2000:]
    assert sorted(p.name for p in cks.iterdir()) == ["step-000002", "step-000004"]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")) == []
    a, k = load_weights(d / "a" / "final"), load_weights(run / "final")
    assert all(a[key].equal(k[key]) for key in a)


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


# ----------------------------------------------------------------------------- SIGINT

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
