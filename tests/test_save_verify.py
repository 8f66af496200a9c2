"""Every save is read back before the run calls it saved (toolkit/storage/verify.py). A clean save passes
on every backend (each run of the backend matrix goes through the same check); here a saved
tensor is really changed on disk after it is written, and the run must stop in one line naming
it, with exit 4, no `final/`, and an earlier `final/` left as it was."""

import json
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from toolkit.storage import checkpoint
from toolkit.storage.verify import first_mismatch, tree_mismatch

from helpers import ROOT, alpaca_rows, base_recipe, load_weights, run_toolkit, write_jsonl, write_recipe

CORRUPT = {"TOOLKIT_FAULT_CORRUPT_SAVE": "1"}


def stop_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.launch
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_corrupted_final_save_stops_the_run_in_one_line(tmp_path, data_files, lora):
    recipe = base_recipe(tmp_path, *data_files, lora={"enabled": lora}, train__max_steps=2)
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    proc = run_toolkit("train", path, env=CORRUPT)
    assert proc.returncode == 4, proc.stderr[-3000:]
    line = stop_line(proc)
    tensor = "lora_A" if lora else "lm_head.weight"  # the first name in the file, which the seam changes
    assert "final.tmp: tensor" in line and tensor in line and "differs from the trained weights" in line, line
    assert "final/ was not written" in line, line
    assert not (tmp_path / "run" / "final").exists()
    assert (tmp_path / "run" / "final.tmp").is_dir()  # kept for inspection


@pytest.mark.launch
def test_a_bad_save_never_replaces_an_earlier_final(tmp_path, data_files):
    """A resumed run with nothing left to train saves final/ again: a bad save must leave the
    earlier final/ exactly as it was."""
    recipe = base_recipe(tmp_path, *data_files, train__max_steps=2, checkpoint={"every_steps": 2})
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    assert run_toolkit("train", path).returncode == 0
    before = load_weights(tmp_path / "run" / "final")
    proc = run_toolkit("train", path, "resume=auto", env=CORRUPT)
    assert proc.returncode == 4, proc.stderr[-3000:]
    stop_line(proc)
    after = load_weights(tmp_path / "run" / "final")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_check_names_missing_empty_reshaped_and_changed_tensors(tmp_path):
    weights = {"a.weight": torch.randn(3, 4), "b.weight": torch.randn(2)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert first_mismatch(tmp_path, weights) is None
    assert "tensor c is missing" in first_mismatch(tmp_path, {**weights, "c": torch.ones(1)})
    save_file({**weights, "b.weight": torch.zeros(0)}, str(tmp_path / "model.safetensors"))
    assert "tensor b.weight was saved empty" in first_mismatch(tmp_path, weights)
    save_file({**weights, "b.weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    assert "tensor b.weight was saved as (3,)" in first_mismatch(tmp_path, weights)
    changed = dict(weights)
    changed["a.weight"] = weights["a.weight"].clone()
    changed["a.weight"][1, 2] += 1e-6
    save_file(changed, str(tmp_path / "model.safetensors"))
    assert "tensor a.weight differs" in first_mismatch(tmp_path, weights)
    (tmp_path / "model.safetensors").unlink()
    assert "no safetensors file" in first_mismatch(tmp_path, weights)


@pytest.mark.launch
def test_zero3_lora_save_is_verified_on_two_ranks(tmp_path, deepspeed_ops):
    """The peers' commonest save bug: ZeRO-3 writing an empty or partial adapter. Here the gathered
    adapter passes the read-back, and a changed tensor stops both ranks (each rank's code is 4)."""
    from helpers import require_op

    require_op(deepspeed_ops, "cpu_adam")
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(32, seed=1))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", alpaca_rows(8, seed=2))
    recipe = base_recipe(tmp_path, train, evaluation, lora={"enabled": True}, train__max_steps=2,
                         train__micro_batch_size=2)
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3}}
    (tmp_path / "z3.json").write_text(json.dumps(ds))
    launch = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
              "num_processes": 2, "machine_rank": 0,
              "deepspeed_config": {"deepspeed_config_file": str(tmp_path / "z3.json"), "zero3_init_flag": True}}
    (tmp_path / "z3.yaml").write_text(yaml.safe_dump(launch))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "z3.yaml"),
                "--main_process_port", "0", "-m"]
    proc = run_toolkit("train", path, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = load_file(str(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    assert adapter and all(t.numel() > 0 for t in adapter.values())

    proc = run_toolkit("train", path, "overwrite=true", launcher=launcher, env=CORRUPT)
    assert proc.returncode != 0
    assert "exitcode  : 4" in proc.stderr or "exit code: 4" in proc.stderr, proc.stderr[-3000:]
    assert sum(line.startswith("stopped:") for line in proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "final").exists()


CHECKPOINT_CASES = {  # launch config (None: one process), LoRA
    "single-full": (None, False),
    "fsdp-full": ("fsdp", False),
    "zero2-full": ("zero2", False),
    "zero3-lora": ("zero3", True),
}


@pytest.mark.launch
@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_a_checkpoint_that_does_not_read_back_is_never_marked_complete(case, tmp_path, data_files):
    """Every rank reads its share of each checkpoint back (weights or adapter, ZeRO's fp32
    partitions, frozen fragments, optimizer state) and compares it with the live state. Here
    step 4's checkpoint is changed on disk after it is written: the run stops in one line with
    exit 4, step 4 is never marked complete, and step 2 (clean, so verified) is what resume uses."""
    from helpers import accelerate_launch, launch_config_for

    backend, lora = CHECKPOINT_CASES[case]
    recipe = base_recipe(tmp_path, *data_files, lora={"enabled": lora}, train__max_steps=6,
                         train__micro_batch_size=2, checkpoint={"every_steps": 2})
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    launcher = accelerate_launch(launch_config_for(backend, tmp_path)) if backend else None
    proc = run_toolkit("train", path, launcher=launcher, env={"TOOLKIT_FAULT_CORRUPT_CHECKPOINT": "4"})
    if backend is None:
        assert proc.returncode == 4, proc.stderr[-3000:]
    else:  # the launcher reports the workers' code
        assert proc.returncode != 0 and "exitcode  : 4" in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "checkpoint step-000004 did not read back as saved" in lines[0], lines[0]
    assert "differs" in lines[0] or "could not be read back" in lines[0], lines[0]
    run = tmp_path / "run"
    assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000002"]
    assert not (run / "checkpoints" / "step-000004").exists() and not (run / "final").exists()
    if backend is None:
        proc = run_toolkit("train", path, "resume=auto")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed from {run / 'checkpoints' / 'step-000002'} at step 2" in proc.stderr + proc.stdout
        assert [p.name for p in checkpoint.complete_checkpoints(run)] == ["step-000004", "step-000006"]


def test_the_read_back_names_the_first_state_that_differs():
    live = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.0, float("nan")])}},
            "param_groups": [{"lr": 1e-3, "params": [0]}]}
    same = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.0, float("nan")])}},
            "param_groups": [{"lr": 5.0, "params": [0]}]}  # only tensors are compared
    assert tree_mismatch(same, live, "optimizer.bin") is None
    changed = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.5, float("nan")])}}}
    assert (tree_mismatch(changed, live, "f")
            == "f.state.0.exp_avg: differs from the trained state (max abs difference 0.5)")
    assert "f.state.0.exp_avg: saved as (1,)" in tree_mismatch({"state": {0: {"step": torch.tensor(3.0),
                                                                             "exp_avg": torch.ones(1)}}}, live, "f")
    assert tree_mismatch({"state": {}}, live, "f") == "f.state.0: missing from the saved file"


@pytest.mark.launch
def test_a_zero3_checkpoint_with_the_shipped_config_reads_back(tmp_path, data_files):
    """accelerate_configs/zero3.yaml as shipped: persistence threshold "auto" (10 x hidden), so the
    norm weights stay whole on every rank but ZeRO-3 writes them as empty placeholders in its model
    states (their values are in the optimizer's fp32 partitions). The read-back must not take that
    for a bad save (it did, on SmolLM2-135M, before this test)."""
    from helpers import accelerate_launch

    recipe = base_recipe(tmp_path, *data_files, train__max_steps=2, train__micro_batch_size=2,
                         checkpoint={"every_steps": 2})
    path = write_recipe(tmp_path / "r.yaml", **recipe)
    proc = run_toolkit("train", path, launcher=accelerate_launch(ROOT / "accelerate_configs" / "zero3.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path / "run")] == ["step-000002"]
