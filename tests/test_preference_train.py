"""Preference training in the loop (preference.method, data.format=preference), launched for real:
DPO equals TRL's DPOTrainer step for step; DPO on 2 processes under DDP, FSDP and ZeRO-3 equals one
process (the reference precomputed for full fine-tuning, the disabled adapter for LoRA); a run
killed by SIGKILL resumes bitwise, and within float tolerance on another backend; ORPO and SimPO
train; the result merges like any run's."""

import json
import math

import pytest
import torch
from objective_runs import assert_runs_close, assert_sigkill_resumes_bitwise, sectioned_recipe, trained

from families import build_family
from helpers import (
    ROOT,
    finish,
    layout_command,
    read_metrics,
    run_toolkit,
    start,
    user_error_line,
    write_jsonl,
    write_recipe,
)

pytestmark = pytest.mark.launch  # every test here starts processes

PAIRS = ROOT / "examples" / "data" / "tasks_preference_train.jsonl"
STEPS = 4


def rows(n: int, skip: int = 0) -> list[dict]:
    with open(PAIRS) as f:
        return [json.loads(line) for line in f][skip:skip + n]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    write_jsonl(root / "train.jsonl", rows(32))
    # 5 eval pairs: on 2 ranks in batches of 2, the second rank's last eval batch is padding only
    write_jsonl(root / "eval.jsonl", rows(5, skip=100))
    return root


def recipe(workdir, name, layout="single", lora=False, method="dpo", **extra):
    return sectioned_recipe(workdir / f"{name}.yaml", {
        "output_dir": str(workdir / name), "seed": 5, "model": {"preset": "tiny-llama-mini"},
        "lora": {"enabled": True, "r": 4, "alpha": 8} if lora else {"enabled": False},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "preference", "max_seq_len": 64},
        "preference": {"method": method},
        "train": {"micro_batch_size": 4 if layout == "single" else 2, "gradient_accumulation_steps": 2,
                  "max_steps": STEPS, "learning_rate": 3e-3 if lora else 1e-3, "eval_every_steps": 2,
                  "log_every_steps": 1},
        "checkpoint": {"every_steps": 1, "keep_last": 10},
    }, **extra)


def command(workdir, layout, path, *overrides):
    return layout_command(workdir, layout, path, *overrides)


def train(workdir, name, layout="single", *overrides, **extra):
    return trained(workdir, layout, recipe(workdir, name, layout, **extra), *overrides)


KEYS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "eval_loss", "eval_reward_margin")


def assert_close(a, b, tol=1e-4, first=0):
    assert_runs_close(a, b, KEYS, STEPS, tol, first)


@pytest.fixture(scope="module")
def single(workdir):
    """One process, full fine-tuning DPO with precomputed reference log-probabilities: the reference
    of the backend cases and of the resume."""
    return train(workdir, "single")


@pytest.fixture(scope="module")
def single_lora(workdir):
    return train(workdir, "single_lora", lora=True)


def test_one_process_dpo_learns_and_logs_its_rewards(single):
    run, log = single
    assert "preference: dpo, beta 0.1, loss_type sigmoid; reference: log-probabilities computed once" in log
    assert "reference: train: computed for 32 pairs" in log and "reference: eval: computed for 5 pairs" in log
    metrics = read_metrics(run)
    assert metrics[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference before step 1
    assert metrics[0]["eval_reward_margin"] == pytest.approx(0, abs=1e-6)
    assert metrics[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    last = metrics[-1]
    assert last["loss"] < math.log(2) and last["reward_margin"] > 0, last  # the training pairs moved apart
    for row in metrics[1:]:
        assert row["reward_margin"] == pytest.approx(row["rewards_chosen"] - row["rewards_rejected"], abs=1e-6)
        assert 0 <= row["reward_accuracy"] <= 1
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "zero3"])
def test_two_processes_equal_one(layout, workdir, single):
    """Precomputed reference (each rank computes its share on the launched backend): the same
    losses, rewards and weights as one process, within 1e-4."""
    run, log = train(workdir, f"full_{layout}", layout)
    assert "reference: train: read from" in log  # the same data and base: computed once, by the first run
    assert_close(single[0], run)


def test_padding_free_equals_padded(workdir, single):
    """data.padding_free: each micro-batch's chosen and rejected sequences in one row without padding
    (varlen attention), the reference precomputed in the same batches: the padded run's result."""
    run, log = train(workdir, "padding_free", **{"data__padding_free": True})
    assert "attention: varlen" in log and "reference: train: computed" in log  # its own reference (another key)
    assert_close(single[0], run, tol=1e-5)


def test_lora_reference_is_the_disabled_adapter_under_zero3(workdir, single_lora):
    run, log = train(workdir, "lora_zero3", "zero3", lora=True)
    assert "reference: the model with its LoRA adapter disabled" in log
    assert read_metrics(single_lora[0])[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert_close(single_lora[0], run)
    merged = run_toolkit("merge", str(run / "final"), "--out", str(workdir / "lora_merged"))  # a DPO adapter merges
    assert merged.returncode == 0 and (workdir / "lora_merged" / "model.safetensors").is_file(), merged.stderr[-2000:]
    evaluated = run_toolkit("eval", str(run / "final"), "--data", str(workdir / "eval.jsonl"), "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    pref = json.loads(evaluated.stdout)["preference"]  # the adapter against its base: the run's last eval
    assert pref["pairs"] == 5
    assert pref["reward_accuracy"] == pytest.approx(read_metrics(run)[-1]["eval_reward_accuracy"], abs=1e-9)


def test_sigkill_resumes_bitwise_and_on_another_backend(workdir, single):
    """Killed after step 2 is logged: resumed on one process it ends bitwise like the run never
    killed; its step-2 checkpoint resumed under FSDP on 2 processes ends within 1e-4."""
    run = assert_sigkill_resumes_bitwise(workdir, recipe(workdir, "killed"), single[0])

    moved = recipe(workdir, "moved", "fsdp", resume=str(run / "checkpoints" / "step-000002"))
    rc, out, err = finish(start(command(workdir, "fsdp", moved)))
    assert rc == 0, err[-3000:]
    assert_close(single[0], workdir / "moved", first=3)


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_reference_free_methods_train(method, workdir):
    run, log = train(workdir, method, method=method, **{"train__max_steps": 2})
    assert f"preference: {method}, beta {0.1 if method == 'orpo' else 2:g}" in log and "no reference model" in log
    assert not any(line.startswith("reference:") for line in log.splitlines())  # nothing precomputed
    metrics = read_metrics(run)
    assert all(math.isfinite(r["loss"]) for r in metrics[1:]) and "eval_reward_accuracy" in metrics[-1]


@pytest.mark.parametrize("loss_type, weights", [("aot", None), (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])])
def test_trls_other_dpo_loss_types_train(loss_type, weights, workdir):
    """A loss type of TRL 1.16's list beyond sigmoid and ipo (aot: the sorted log-ratios of each micro-batch's
    pairs; before step 1 the policy is the reference, so its loss is ln 2), and several combined with
    preference.loss_weights (TRL's MPO), train end to end (tests/test_dpo_losses.py compares each loss with TRL's)."""
    name = "aot" if weights is None else "mpo"
    run, log = train(workdir, name, **{"preference__loss_type": loss_type, "preference__loss_weights": weights,
                                       "train__max_steps": 2})
    described = "aot" if weights is None else "sigmoid+bco_pair+sft x 0.8, 0.2, 1"
    assert f"preference: dpo, beta 0.1, loss_type {described}; reference:" in log
    metrics = read_metrics(run)
    assert all(math.isfinite(r["loss"]) for r in metrics[1:]) and "eval_reward_accuracy" in metrics[-1]
    if weights is None:
        assert metrics[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    else:  # 0.8 ln 2 + 0.2 x 2 ln 2 and the chosen completions' NLL
        assert metrics[0]["eval_loss"] > 1.2 * math.log(2) + 0.1


def test_dpo_matches_trl(tmp_path):
    """Full fine-tuning DPO, one process, fp32, 4 pairs (one global batch, so the batch order cannot
    differ), AdamW without weight decay, clipping at 1.0, constant learning rate: the losses and
    chosen rewards of steps 1 and 2 equal TRL DPOTrainer's within 1e-4."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    folder = build_family("llama3", tmp_path / "llama3")
    pairs = rows(4)
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    path = write_recipe(tmp_path / "dpo.yaml", output_dir=str(tmp_path / "ours"), seed=0, model={"path": str(folder)},
                        data={"train_files": [str(data)], "format": "preference", "max_seq_len": 128},
                        preference={"method": "dpo", "beta": 0.1},
                        train={"micro_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3, "min_lr_ratio": 1.0,
                               "max_grad_norm": 1.0, "weight_decay": 0.0, "log_every_steps": 1})
    result = run_toolkit("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    ours = read_metrics(tmp_path / "ours")[1:]

    torch.manual_seed(0)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, learning_rate=1e-3,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=2,
                     logging_steps=1, beta=0.1, max_length=128, seed=0, report_to=[], use_cpu=True, bf16=False,
                     save_strategy="no", dataloader_num_workers=0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), args=args,
                         train_dataset=Dataset.from_list(pairs), processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == len(ours) == 2
    for mine, trl in zip(ours, theirs):
        assert mine["loss"] == pytest.approx(trl["loss"], rel=1e-4, abs=1e-6), (mine, trl)
        assert mine["rewards_chosen"] == pytest.approx(trl["rewards/chosen"], rel=1e-4, abs=1e-6), (mine, trl)
        assert mine["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4), (mine, trl)
    assert ours[1]["loss"] < ours[0]["loss"]  # step 2 moved: the comparison is not of two ln 2s


def test_bad_preference_recipes_are_refused_in_one_line(workdir):
    path = recipe(workdir, "bad", **{"data__format": "messages"})
    line = user_error_line(run_toolkit("train", str(path)))
    assert "data.format" in line and "preference" in line, line
