"""Away from the happy path: what a new user hits with odd eval sizes, resumes into the wrong
place or under another backend layout, signals at odd moments, interrupted saves, and typos.
Each case here failed on the main branch before its fix."""

import json
import shutil
import signal
import sys
import time

import pytest
import torch
import yaml

from helpers import (alpaca_rows, base_recipe, finish, load_weights, read_metrics, run_toolkit, start,
                      user_error_line, write_jsonl, write_recipe)
from test_bad_input import snapshot
from test_deepspeed_config import TRAINER_STYLE
from toolkit.storage import checkpoint
from toolkit.config import ConfigError, load_recipe
from toolkit.data.batching import Collator, EvalShardSampler


# ----------------------------------------------------------------------------- eval padding


def test_a_rank_whose_eval_share_is_all_padding_gets_a_batch():
    """9 eval rows, 2 ranks, eval batches of 2: rank 1 holds 4 rows and pads to 3 batches, the last
    of which has no row at all (it once crashed the collator with `max() arg is an empty sequence`)."""
    rows = [{"input_ids": [5, 6, 7][: 1 + i % 3], "labels": [5, 6, 7][: 1 + i % 3]} for i in range(9)]
    for packed in (False, True):
        data = [dict(r, position_ids=list(range(len(r["input_ids"])))) if packed else r for r in rows]
        sampler = EvalShardSampler(len(data), 2, rank=1, world=2)
        batches = list(torch_loader(Rows(data), sampler, Collator(0, packed=packed)))
        assert len(batches) == 3
        last = batches[-1]
        assert last["input_ids"].shape == (2, 1) and (last["labels"] == -100).all()
        assert ("position_ids" in last) == packed and ("attention_mask" in last) != packed


class Rows(torch.utils.data.Dataset):
    """Examples by index, None (eval padding) as None, as toolkit.data.batching.Examples reads them from Arrow."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return None if i is None else self.rows[i]


def torch_loader(dataset, sampler, collate):
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=collate)


# ----------------------------------------------------------------------------- DeepSpeed: summary, layout


def ds_launch(tmp_path, name: str, ds: dict, recipe: dict):
    (tmp_path / f"{name}.json").write_text(json.dumps(ds))
    launch = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
              "num_processes": 2, "machine_rank": 0,
              "deepspeed_config": {"deepspeed_config_file": str(tmp_path / f"{name}.json"), "zero3_init_flag": False}}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(launch))
    path = write_recipe(tmp_path / f"{name}_recipe.yaml", **recipe)
    return run_toolkit("train", path, launcher=[sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                                str(tmp_path / f"{name}.yaml"), "--main_process_port", "0", "-m"])


@pytest.mark.launch
def test_zero2_run_says_its_schedule_came_from_the_json_and_resumes_under_zero3(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(32, seed=1))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", alpaca_rows(9, seed=2))  # rank 1's last eval batch: padding only
    recipe = base_recipe(tmp_path, train, evaluation, train__max_steps=2, train__micro_batch_size=2,
                         train__eval_batch_size=2, train__warmup_steps=1, checkpoint={"every_steps": 2})
    proc = ds_launch(tmp_path, "zero2", TRAINER_STYLE, recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_lines = [line[len("run: "):] for line in proc.stderr.splitlines() if line.startswith("run: ")]
    schedule = [line for line in run_lines if line.startswith("schedule ")]
    assert schedule and schedule[0].startswith(f"schedule WarmupDecayLR from {tmp_path / 'zero2.json'}: "), run_lines
    assert "total_num_steps 2" in schedule[0] and "the recipe's warmup-cosine and min_lr_ratio are not used" in schedule[0]
    assert any(line.startswith("optimizer AdamW from ") for line in run_lines), run_lines
    assert any(line.startswith("backend DeepSpeed ZeRO-2, 2 processes") for line in run_lines), run_lines
    assert any("batch 8 sequences per optimizer step = micro_batch_size 2 x gradient_accumulation_steps 2 x 2 "
               "processes" in line for line in run_lines), run_lines
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["launches"][0]["summary"] == run_lines and manifest["launches"][0]["layout"] == "DeepSpeed ZeRO-2"
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "eval_loss" in r] == [0, 2]

    # Under ZeRO-3 with another split of the global batch: refused in one line naming both, nothing touched.
    zero3 = dict(TRAINER_STYLE, zero_optimization={"stage": 3})
    before = snapshot(tmp_path / "run")
    smaller = {**recipe, "resume": "auto", "train": {**recipe["train"], "micro_batch_size": 1}}
    error = user_error_line(ds_launch(tmp_path, "zero3", zero3, smaller), launched=True)
    assert "global batch of 8 sequences and this launch makes 4" in error, error
    assert snapshot(tmp_path / "run") == before
    # The same global batch continues under ZeRO-3 from the portable state, DeepSpeed's own optimizer
    # and WarmupDecayLR included (the run had finished: it loads, checks and saves final/ again).
    proc = ds_launch(tmp_path, "zero3", zero3, {**recipe, "resume": "auto"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(written by 2 process(es) under DeepSpeed ZeRO-2: its portable state)" in proc.stdout + proc.stderr
    assert "loaded and read back as saved" in proc.stderr


# ----------------------------------------------------------------------------- resume by path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished single-process run with checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("edges")
    train = write_jsonl(d / "train.jsonl", alpaca_rows(32, seed=1))
    evaluation = write_jsonl(d / "eval.jsonl", alpaca_rows(4, seed=2))
    recipe = base_recipe(d, train, evaluation, out="a", train__max_steps=4, train__micro_batch_size=2,
                         checkpoint={"every_steps": 2, "keep_last": 5})
    proc = run_toolkit("train", write_recipe(d / "a.yaml", **recipe))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return d, recipe


@pytest.mark.launch
def test_resume_by_path_never_writes_into_another_run(finished_run):
    d, recipe = finished_run
    step2 = d / "a" / "checkpoints" / "step-000002"
    other = d / "b"
    shutil.copytree(d / "a", other)  # someone's earlier results
    before_a, before_b = snapshot(d / "a"), snapshot(other)

    error = user_error_line(run_toolkit("train", write_recipe(d / "into_b.yaml", **{**recipe, "output_dir": str(other)}),
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


@pytest.mark.launch
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


# ----------------------------------------------------------------------------- signals and typos


@pytest.mark.launch
def test_sigterm_before_training_is_one_line_and_exit_75(tmp_path, data_files):
    """While torch imports (well before the loop): the handler is installed by the CLI first."""
    path = write_recipe(tmp_path / "r.yaml", **base_recipe(tmp_path, *data_files))
    proc = start([sys.executable, "-m", "toolkit", "train", str(path)])
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc, timeout=120)
    assert code == 75, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["stopped: preempted: SIGTERM before training started; nothing was trained or saved. "
                     "Run again to start over"], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, words", [
    ("train.max_step=3", "train.max_step: unknown key; did you mean max_steps?"),
    ("max_steps=3", "max_steps: unknown key; did you mean train.max_steps?"),
    ("lora.rank=3", "lora.rank: unknown key (known here"),  # nothing close: no guess
])
def test_unknown_keys_suggest_the_near_miss(tmp_path, override, words):
    path = write_recipe(tmp_path / "r.yaml", output_dir="o", model={"preset": "tiny-llama"},
                        data={"train_files": ["a.jsonl"]})
    with pytest.raises(ConfigError) as e:
        load_recipe(path, [override])
    assert words in str(e.value)


def test_deepspeed_min_loss_scale_is_a_stop_not_a_crash():
    """DeepSpeed's own loss scaler, at its minimum, overflowing again: the exception it raises is
    recognised as a stop (exit 3 in the loop; tests/test_gpu.py runs it on CUDA)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from toolkit.backends import Backend, DeepSpeed

    scaler = DynamicLossScaler(init_scale=1, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False, raise_error_at_min_scale=True)
    with pytest.raises(Exception) as e:
        scaler.update_scale(overflow=True)
    assert DeepSpeed("deepspeed").step_failure(e.value) == (
        "fp16 gradients still overflow with the loss scale at its minimum (DeepSpeed fp16.min_loss_scale)")
    assert DeepSpeed("deepspeed").step_failure(RuntimeError("shape mismatch")) is None
    assert Backend().step_failure(e.value) is None  # only DeepSpeed's scaler says it this way
