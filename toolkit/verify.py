"""Read a saved model back before calling it saved: every tensor the trained model holds must be in
the safetensors files, non-empty, of its shape and dtype, and equal to the live (gathered) weights.
The peers' commonest silent failure is a sharded run that writes an empty or partial adapter,
found only when someone loads it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

EXIT_SAVE_MISMATCH = 4


def saved_tensors(folder: Path) -> dict[str, tuple[Path, str]]:
    """Tensor name -> (file, name) over every safetensors file of a saved folder."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = (f, k)
    return out


def first_mismatch(folder: Path, expected: dict[str, torch.Tensor]) -> str | None:
    """None when `folder` holds `expected`; else one line naming the first tensor that differs.
    A name missing from the files is allowed only as a tied copy (the same storage as a name
    that is saved), which is how transformers writes tied embeddings."""
    from safetensors import safe_open

    saved = saved_tensors(folder)
    if not saved:
        return f"{folder}: no safetensors file was written"
    by_storage: dict[tuple, str] = {}
    for k, v in expected.items():
        if k in saved:
            by_storage.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)), k)
    for k, v in expected.items():
        if k not in saved:
            twin = by_storage.get((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)))
            if twin is None:
                return f"{folder}: tensor {k} is missing from the saved files"
            continue
        f, name = saved[k]
        with safe_open(str(f), framework="pt") as fh:
            got = fh.get_tensor(name)
        if got.numel() == 0 or v.numel() == 0:
            return f"{folder}: tensor {k} was saved empty (shape {tuple(got.shape)}; trained {tuple(v.shape)})"
        if got.shape != v.shape or got.dtype != v.dtype:
            return (f"{folder}: tensor {k} was saved as {tuple(got.shape)} {got.dtype}, "
                    f"trained as {tuple(v.shape)} {v.dtype}")
        if not torch.equal(got, v):
            diff = (got.double() - v.double()).abs().max().item()
            return f"{folder}: tensor {k} differs from the trained weights (max abs difference {diff:.3g})"
    return None


def inject_corruption(folder: Path) -> None:
    """Test seam: TOOLKIT_FAULT_CORRUPT_SAVE=1 changes one saved tensor after it is written (as a
    bad disk or a broken gather would), so the check above runs on a real bad file."""
    if os.environ.get("TOOLKIT_FAULT_CORRUPT_SAVE") != "1":
        return
    from safetensors.torch import load_file, save_file

    f = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(f), metadata={"format": "pt"})
