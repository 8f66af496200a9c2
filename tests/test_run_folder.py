"""The run folder as a new user meets it (toolkit/storage/run_folder.py), on real launches of the
CLI: overwrite=true keeps an earlier run until the new one has started (a bad data file leaves it
as it was), replaces it then, and never clears a folder that is not a run; a second run into a
folder in use is refused, and the lock of a run that died is taken over; a refused run leaves no
folder behind; and resume=auto continues after a kill that cut metrics.jsonl mid-line, and accepts
changes that learn nothing else. Nothing is lost, nothing silently changed, and every refusal is
one line. (Checkpoints across launches, resume by path and the resumes refused are in
test_checkpoints.py; kills and signals in test_resume.py and test_faults.py.)"""

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    alpaca_folder,
    finish,
    run_toolkit,
    short_recipe,
    start,
    user_error_line,
)

pytestmark = pytest.mark.launch  # every test here starts processes


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return alpaca_folder(tmp_path_factory.mktemp("run_folder"))


recipe = short_recipe


@pytest.fixture(scope="module")
def finished(work):
    """A finished run with a checkpoint: the folder users fear losing."""
    proc = run_toolkit("train", recipe(work, "old"), "checkpoint.every_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "old"


# ----------------------------------------------------------------------------- overwrite, lock


def test_overwrite_with_a_bad_data_file_keeps_the_earlier_run(work, finished):
    before = snapshot(finished)
    proc = run_toolkit("train", recipe(work, "old"), "overwrite=true", f"data.train_files=[{work / 'typo.jsonl'}]")
    assert "data.train_files: file not found" in user_error_line(proc)
    assert snapshot(finished) == before


def test_overwrite_never_clears_a_folder_that_is_not_a_run(work):
    proj = work / "proj"
    proj.mkdir()
    shutil.copy(work / "train.jsonl", proj / "train.jsonl")
    (proj / "notes.txt").write_text("mine")
    before = snapshot(proj)
    proc = run_toolkit("train", recipe(work, "p"), f"output_dir={proj}", "overwrite=true",
                       f"data.train_files=[{proj / 'train.jsonl'}]")
    assert "is not a toolkit run folder (it holds notes.txt, train.jsonl)" in user_error_line(proc)
    assert snapshot(proj) == before


def test_overwrite_replaces_a_run_only_once_the_new_one_starts(work, finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    proc = run_toolkit("train", recipe(work, "again"), f"output_dir={run}", "overwrite=true", "train.max_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "overwrite: removed the earlier run's checkpoints, config.yaml, final" in proc.stdout
    assert not (run / "checkpoints").exists()  # the new run took none
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_dead_ones_lock_is_taken_over(work, tmp_path):
    out = tmp_path / "busy"
    first = start([sys.executable, "-m", "toolkit", "train", recipe(work, "busy"), f"output_dir={out}",
                   "train.max_steps=100000", "train.log_every_steps=100000"])
    lock = out / ".toolkit.lock"
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert json.loads(lock.read_text())["pid"] == first.pid
    second = run_toolkit("train", recipe(work, "busy"), f"output_dir={out}", "resume=auto")
    assert f"is in use by process {first.pid}" in user_error_line(second)
    first.kill()  # SIGKILL: its lock stays behind
    finish(first)
    assert lock.exists()
    again = run_toolkit("train", recipe(work, "busy"), f"output_dir={out}", "overwrite=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"took over the lock of process {first.pid}" in again.stdout
    assert not lock.exists()


def test_a_refused_run_leaves_no_folder_behind(work, tmp_path):
    proc = run_toolkit("train", recipe(work, "x"), f"output_dir={tmp_path / 'new'}", "train.micro_batch_size=4096")
    assert "training rows do not fill one global batch of" in user_error_line(proc)
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- resume


def test_resume_after_a_kill_that_cut_metrics_mid_line(work, tmp_path):
    out = tmp_path / "cut"
    proc = run_toolkit("train", recipe(work, "cut"), f"output_dir={out}", "checkpoint.every_steps=1")
    assert proc.returncode == 0
    shutil.rmtree(out / "final")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 1.2')  # the kill landed mid-write
    proc = run_toolkit("train", recipe(work, "cut"), f"output_dir={out}", "checkpoint.every_steps=1", "resume=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


@pytest.mark.parametrize("change", [["data.eval_files=[]"], pytest.param(["data.num_proc=1"], marks=pytest.mark.slow),
                                    pytest.param(["train.eval_every_steps=2"], marks=pytest.mark.slow)])
def test_resume_allows_changes_that_learn_nothing_else(work, tmp_path, change):
    out = tmp_path / "r"
    first = run_toolkit("train", recipe(work, "r"), f"output_dir={out}", "checkpoint.every_steps=1",
                        "train.max_steps=2")
    assert first.returncode == 0
    shutil.rmtree(out / "final")
    proc = run_toolkit("train", recipe(work, "r"), f"output_dir={out}", "checkpoint.every_steps=1",
                       "train.max_steps=2", "resume=auto", *change)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
