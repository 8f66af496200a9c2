"""QLoRA (model.load_in_4bit) on a CPU host, as CI runs it: bitsandbytes 0.50 loads a tiny Llama's
linear layers as NF4 and a LoRA adapter trains over them, in fp32 and in bf16. On 2 processes under
DDP, FSDP2 (the 4-bit weights sharded as fp32 elements, bnb_4bit_quant_storage) and ZeRO-3 (the 4-bit
weights partitioned) it learns what one process learns, within 1e-4; a run killed after a
checkpoint resumes to bitwise the uninterrupted one; the adapter merges into the full-precision base,
checked against the adapter on that base, with the base's quantization error measured and said."""

import math

import pytest
import torch

from toolkit.config import ConfigError, ModelConfig, load_recipe
from toolkit.model.load import build_byte_tokenizer, build_model, count_parameters
from toolkit.observe.measure import MEASURED

from helpers import (
    accelerate_launch,
    alpaca_rows,
    launch_config_for,
    load_weights,
    read_metrics,
    run_toolkit,
    write_jsonl,
    write_recipe,
)

bitsandbytes = pytest.importorskip("bitsandbytes")  # in the test extra (pyproject.toml), pinned in constraints.txt

STEPS = 4
# The 2 shared cores: one thread per process, as accelerate gives each of its ranks, so a one-process
# run does not wait on a core another test holds (1.6 s a step against 0.15 s under load).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def tiny_folder(folder):
    """A local Hugging Face folder of the tiny-llama-mini preset, full precision: QLoRA's base."""
    build_model(ModelConfig(preset="tiny-llama-mini")).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    tiny_folder(root / "base")
    write_jsonl(root / "train.jsonl", alpaca_rows(48, seed=5))
    write_jsonl(root / "eval.jsonl", alpaca_rows(6, seed=6))
    return root


def recipe(workdir, name, layout="single", precision="fp32", **train):
    return write_recipe(
        workdir / f"{name}.yaml", output_dir=str(workdir / name), seed=3,
        model={"path": str(workdir / "base"), "load_in_4bit": True},
        lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"},
        data={"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
              "format": "alpaca", "max_seq_len": 96},
        train={"micro_batch_size": 4 if layout == "single" else 2, "gradient_accumulation_steps": 2,
               "max_steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 1, "eval_every_steps": 2,
               "log_every_steps": 1, "precision": precision, **train},
        checkpoint={"every_steps": 1, "keep_last": 10})


def train(workdir, name, layout="single", *overrides, env=None, **kwargs):
    path = recipe(workdir, name, layout, **kwargs)
    launcher = None if layout == "single" else accelerate_launch(launch_config_for(layout, workdir))
    proc = run_toolkit("train", path, *overrides, launcher=launcher, env={**ONE_THREAD, **(env or {})})
    return workdir / name, proc


@pytest.fixture(scope="module")
def single(workdir):
    """One process, fp32: the reference of the backends, the resume and the merge."""
    run, proc = train(workdir, "single")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout + proc.stderr


def assert_close(a, b, tol=1e-4) -> float:
    """Losses, eval losses and the final adapters of two runs within `tol`; returns the largest difference."""
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(STEPS + 1))
    worst = 0.0
    for x, y in zip(ra, rb):
        for k in ("loss", "eval_loss", "grad_norm"):
            if x.get(k) is not None or y.get(k) is not None:
                assert math.isclose(x[k], y[k], rel_tol=tol, abs_tol=tol), (x["step"], k, x[k], y[k])
                worst = max(worst, abs(x[k] - y[k]))
    wa, wb = load_weights(a / "final"), load_weights(b / "final")
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=tol, atol=tol, msg=k)
        worst = max(worst, float((wa[k] - wb[k]).abs().max()))
    return worst


# ----------------------------------------------------------------------------- unit: no process


def test_a_4bit_base_loads_on_this_cpu_and_runs_as_in_training(tmp_path):
    """Linear4bit layers on the CPU, counted at their full size; eval mode computes as training does
    (bitsandbytes' AVX512-BF16 path would repack the weights in place, and fails on the preset's
    176-wide MLP: toolkit.model.load.one_4bit_path)."""
    folder = tiny_folder(tmp_path / "base")
    full = count_parameters(build_model(ModelConfig(path=str(folder))))[1]
    model = build_model(ModelConfig(path=str(folder), load_in_4bit=True), compute_dtype=torch.float32)
    layers = [m for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert len(layers) == 14 and all(m.weight.device.type == "cpu" for m in layers)
    assert count_parameters(model)[1] == full
    ids = torch.arange(24)[None] * 5 % 262
    model.train()
    trained = model(input_ids=ids).logits
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, trained.detach(), rtol=0, atol=0)


def test_qlora_recipes_are_refused_in_one_line_where_they_cannot_run(tmp_path, monkeypatch):
    import importlib.util

    base = {"output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path), "load_in_4bit": True},
            "lora": {"enabled": True}, "data": {"train_files": ["x.jsonl"]}}
    assert load_recipe(write_recipe(tmp_path / "fp32.yaml", **base)).train.precision == "fp32"  # fp32 computes too
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"model.load_in_4bit: QLoRA's 4-bit layers come from bitsandbytes, "
                                          r"which is not installed: .*pip install bitsandbytes"):
        load_recipe(write_recipe(tmp_path / "r.yaml", **base))


# ----------------------------------------------------------------------------- launched


@pytest.mark.launch
def test_one_process_trains_over_the_4bit_base(single):
    run, log = single
    full = count_parameters(build_model(ModelConfig(preset="tiny-llama-mini")))[1]
    assert f"parameters: 9,344 trainable of {full + 9344:,}" in log  # the 4-bit weights counted at their full size
    metrics = read_metrics(run)
    losses = [r["loss"] for r in metrics if "loss" in r]
    evals = [r["eval_loss"] for r in metrics if "eval_loss" in r]
    assert losses[-1] < losses[0] and evals[-1] < evals[0], metrics
    assert sorted(p.name for p in (run / "final").glob("*.safetensors")) == ["adapter_model.safetensors"]


@pytest.mark.launch
def test_bf16_trains_over_the_4bit_base(workdir):
    """bf16 (autocast on the CPU, the 4-bit weights stored and computed in bf16) trains: losses fall. With
    gradient checkpointing, which peft's QLoRA preparation enables again: non-reentrant, as everywhere (it
    left use_reentrant unset: torch's warning, and the reentrant kind)."""
    run, proc = train(workdir, "bf16", "single", "model.gradient_checkpointing=true", precision="bf16", max_steps=3,
                      eval_every_steps=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "use_reentrant" not in proc.stderr, proc.stderr[-3000:]
    metrics = read_metrics(run)
    assert metrics[-1]["loss"] < metrics[1]["loss"] and metrics[-1]["eval_loss"] < metrics[0]["eval_loss"], metrics


@pytest.mark.launch
@pytest.mark.parametrize("layout, backend", [("ddp", "DDP"), ("fsdp", "FSDP2"), ("zero3", "DeepSpeed ZeRO-3")])
def test_two_processes_equal_one(layout, backend, workdir, single):
    run, proc = train(workdir, f"two_{layout}", layout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"run: backend {backend}" in proc.stdout + proc.stderr
    worst = assert_close(single[0], run)
    print(f"{layout}: largest difference from one process {worst:.2e}")


@pytest.mark.launch
def test_sigkill_after_a_checkpoint_resumes_bitwise(workdir, single):
    """Killed (SIGKILL) in step 2's forward, after step 1's checkpoint: resumed, it ends bitwise like
    the run never killed, its 4-bit base loaded again from the folder."""
    run, proc = train(workdir, "killed", env={"TOOLKIT_FAULT_SIGNAL": "step:KILL"})
    assert proc.returncode == -9 and not (run / "final").exists(), proc.stderr[-2000:]
    assert (run / "checkpoints" / "step-000001").is_dir()
    run, proc = train(workdir, "killed", "single", "resume=auto")
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]

    def comparable(folder):
        return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(folder)]

    assert comparable(run) == comparable(single[0])
    want, have = load_weights(single[0] / "final"), load_weights(run / "final")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)


@pytest.mark.launch
def test_merge_folds_into_the_full_precision_base(workdir, single):
    """The merged folder is the full-precision base plus the adapter: checked against the adapter on
    that base (fp32 tolerance); the difference from the trained model (the adapter over the 4-bit base)
    is the base's quantization error, measured and said, not checked."""
    from transformers import AutoModelForCausalLM

    out = workdir / "merged"
    proc = run_toolkit("merge", single[0] / "final", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained over the base in 4-bit (QLoRA)" in proc.stdout
    checked = next(line for line in proc.stdout.splitlines() if line.startswith("check: merged vs base + adapter"))
    assert float(checked.split("max |logit difference| ")[1].split()[0]) < 1e-4, checked
    measured = next(line for line in proc.stdout.splitlines() if "4-bit (NF4) base it was trained on" in line)
    assert 1e-4 < float(measured.split("max |logit difference| ")[1].split(",")[0]) < 1, measured
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in merged.modules())
    assert "quantization_config" not in (out / "config.json").read_text()

