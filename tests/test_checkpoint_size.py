"""A checkpoint holds what is trained, not what is frozen: a LoRA run's checkpoint keeps the
adapter, its optimizer state and the run's counters, never the base model the adapter was built
on (a resume builds it again from the recipe, as the portable state already assumed), and still
resumes to bitwise the run that was never interrupted.

Before this guard, a LoRA checkpoint held the whole base model on every backend (597 MB for
SmolLM2-135M with a 10 MB adapter, r 8 on all linear layers; ~16 GB a checkpoint at 8B), all of it
written and read back at every save. Now one process, DDP, DeepSpeed (ZeRO-2/3) and FSDP2 leave
the frozen weights out (`Backend.save_state`, `Backend.frozen_left_out`).
"""

import pytest
import torch
from safetensors.torch import load_file

from toolkit.backends.base import leaving_frozen_out
from toolkit.observe.measure import MEASURED

from helpers import (
    alpaca_rows,
    finish,
    layout_command,
    layout_recipe,
    load_weights,
    read_metrics,
    run_toolkit,
    start,
    write_jsonl,
    write_recipe,
)

RESUME_AT = 6  # of helpers.RESUME_STEPS (8), checkpoints every 2 steps


def tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def saved_bytes(step) -> int:
    """The bytes of tensor data in the backend's own files of a checkpoint (outside portable/):
    its weights and optimizer state, without the files' own overhead (torch.distributed.checkpoint
    writes more of it than the tiny adapter's data)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for f in step.rglob("*"):
        if "portable" in f.relative_to(step).parts or not f.is_file():
            continue
        if f.suffix == ".safetensors":
            total += tensor_bytes(load_file(f))
        elif f.suffix in (".bin", ".pt"):
            total += tensor_bytes(torch.load(f, map_location="cpu", weights_only=False))
        elif f.name == ".metadata":  # a torch.distributed.checkpoint folder: all ranks' shards
            for meta in FileSystemReader(str(f.parent)).read_metadata().state_dict_metadata.values():
                if isinstance(meta, TensorStorageMetadata):
                    total += meta.size.numel() * torch.empty((), dtype=meta.properties.dtype).element_size()
    return total


def portable_bytes(step) -> int:
    """The trained weights and their AdamW moments, fp32, as portable/ holds them."""
    return sum(tensor_bytes(load_file(step / "portable" / name))
               for name in ("weights.safetensors", "moments.safetensors"))


class Quantized(torch.nn.Linear):
    """Saves a companion of its weight, as bitsandbytes' 4-bit layers save their quantization state."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight.absmax"] = torch.ones(1)


def test_frozen_parameters_are_left_out_of_the_state_dict_and_not_missed_when_it_loads():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5), Quantized(5, 2))
    model[1].weight = model[0].weight  # tied, as input embeddings and output layer often are
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    trained = {"1.bias": torch.ones(5), "2.bias": torch.ones(2)}
    with leaving_frozen_out(model):
        assert list(model.state_dict()) == list(trained)  # the tied frozen weight by both names, the companion
        model.load_state_dict(trained)  # strict
        with pytest.raises(RuntimeError, match="Missing key"):  # a trained tensor is still required
            model.load_state_dict({"1.bias": torch.ones(5)})
    assert list(model.state_dict()) == ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias", "2.weight.absmax"]
    assert torch.equal(model[1].bias, torch.ones(5))
    with pytest.raises(RuntimeError, match="Missing key"):  # only inside the block
        model.load_state_dict(trained)


@pytest.mark.launch
# DDP saves as one process does and ZeRO-2 as ZeRO-3's engine does: those two resumes run by hand (`-m slow`),
# within CI's budget; their uninterrupted runs (shared with test_backends.py) are still checked in CI there.
@pytest.mark.parametrize("layout", ["single", pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("zero2", marks=pytest.mark.slow), "zero3", "fsdp"])
def test_a_lora_checkpoint_holds_no_base_weights_and_resumes_bitwise(layout, layout_dir, layout_runs):
    """The uninterrupted LoRA run of helpers.layout_recipe (conftest's `layout_runs`, shared with
    test_backends.py and test_portable_resume.py): the weights and optimizer state in its
    checkpoint's own files are under twice the adapter and its moments (measured: 1.0x, ZeRO-2
    1.33x with the adapter in its module state too; before: 5.5x, ZeRO-2 10.3x, the tiny preset's
    base being 12 times its adapter). A run resumed from its step-6 checkpoint under the same
    launch ends bitwise where it ended."""
    reference = layout_runs(layout, True)
    step = reference / "checkpoints" / f"step-{RESUME_AT:06d}"
    saved, trained = saved_bytes(step), portable_bytes(step)
    assert saved < 2 * trained, f"{layout}: {saved} bytes of weights and optimizer state for {trained} trained"
    if (step / "model.safetensors").is_file():  # one process, DDP: exactly the trained tensors
        assert load_weights(step).keys() == load_file(step / "portable" / "weights.safetensors").keys()

    name = f"lora_resumed_{layout}"
    path = layout_recipe(layout_dir, name, layout, lora=True)
    rc, out, err = finish(start(layout_command(layout_dir, layout, path, f"resume={step}")))
    assert rc == 0, err[-3000:]
    assert f"resumed from {step} at step {RESUME_AT}" in out, out[-2000:]

    def after(run):
        return [{k: v for k, v in r.items() if k not in MEASURED} for r in read_metrics(run) if r["step"] > RESUME_AT]

    assert after(layout_dir / name) == after(reference) and after(reference)
    want, have = load_weights(reference / "final"), load_weights(layout_dir / name / "final")
    assert want.keys() == have.keys() and want
    assert [k for k in want if not torch.equal(want[k], have[k])] == []


@pytest.mark.launch
@pytest.mark.real_model
def test_a_lora_checkpoint_of_the_real_model_is_under_twice_its_adapter_and_optimizer_state(tmp_path,
                                                                                           real_model_dir):
    """SmolLM2-135M-Instruct, LoRA r 8 on all linear layers, one process, one step. The checkpoint
    holds the adapter and its AdamW state twice (the backend's files and portable/) and nothing of
    the 538 MB base. Measured: 59.3 MB for a 9.8 MB adapter and a 19.9 MB optimizer.bin
    (1.995x); 597 MB before."""
    train = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(8, seed=1))
    out = tmp_path / "run"
    recipe = write_recipe(
        tmp_path / "lora.yaml", output_dir=str(out), seed=3, model={"path": str(real_model_dir)},
        lora={"enabled": True, "r": 8, "alpha": 16, "target_modules": "all-linear"},
        data={"train_files": [str(train)], "format": "alpaca", "max_seq_len": 64},
        train={"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 1, "learning_rate": 1e-3,
               "warmup_steps": 0, "precision": "fp32"},
        checkpoint={"every_steps": 1})
    proc = run_toolkit("train", recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = out / "checkpoints" / "step-000001"
    total = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    adapter = (out / "final" / "adapter_model.safetensors").stat().st_size
    optimizer = (step / "optimizer.bin").stat().st_size
    print(f"\ncheckpoint {total:,} bytes; adapter {adapter:,} + optimizer state {optimizer:,} "
          f"({total / (adapter + optimizer):.3f}x)")
    assert total < 2 * (adapter + optimizer), (total, adapter, optimizer)
