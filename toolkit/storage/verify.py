"""Read a saved model back before calling it saved: every tensor the trained model holds must be in
the safetensors files, non-empty, of its shape and dtype, and equal to the live (gathered) weights.
The peers' commonest silent failure is a sharded run that writes an empty or partial adapter,
found only when someone loads it."""

from __future__ import annotations

import os
from pathlib import Path

import torch


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
        v = v.detach().to(got.device)  # a live weight on the GPU against the file's (the H200 stopped every
        if not torch.equal(got, v):  # single-process checkpoint here, 2026-11-27: torch.equal across devices)
            diff = (got.double() - v.double()).abs().max().item()
            return f"{folder}: tensor {k} differs from the trained weights (max abs difference {diff:.3g})"
    return None


def inject_corruption(folder: Path, force: bool = False) -> None:
    """Test seam: TOOLKIT_FAULT_CORRUPT_SAVE=1 changes one saved tensor after it is written (as a
    bad disk or a broken gather would), so the check above runs on a real bad file."""
    if os.environ.get("TOOLKIT_FAULT_CORRUPT_SAVE") != "1" and not force:
        return
    from safetensors.torch import load_file, save_file

    f = sorted(folder.glob("*.safetensors"))[0]
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(f), metadata={"format": "pt"})


def tree_mismatch(saved, live, where: str) -> str | None:
    """None when every tensor of `live` (a state dict: nested dicts, lists, tuples) is at the same
    place in `saved` with its shape, dtype and values; else one line naming the first that is not.
    Sharded tensors (DTensor) are compared by this rank's local part."""
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return f"{where}: expected a mapping, read back {type(saved).__name__}"
        for k, v in live.items():
            if k not in saved:
                return f"{where}.{k}: missing from the saved file"
            problem = tree_mismatch(saved[k], v, f"{where}.{k}")
            if problem:
                return problem
        return None
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            return f"{where}: expected {len(live)} entries, read back {saved!r:.80}"
        for i, (s, v) in enumerate(zip(saved, live)):
            problem = tree_mismatch(s, v, f"{where}.{i}")
            if problem:
                return problem
        return None
    if not isinstance(live, torch.Tensor):
        return None
    if not isinstance(saved, torch.Tensor):
        return f"{where}: expected a tensor, read back {type(saved).__name__}"
    saved, live = (t.to_local() if hasattr(t, "to_local") else t for t in (saved, live))
    if saved.shape != live.shape or saved.dtype != live.dtype:
        return f"{where}: saved as {tuple(saved.shape)} {saved.dtype}, trained as {tuple(live.shape)} {live.dtype}"
    live = live.detach().to(saved.device)
    both_nan = saved.isnan() & live.isnan() if saved.is_floating_point() else torch.zeros_like(saved, dtype=torch.bool)
    same = (saved == live) | both_nan
    if not bool(same.all()):
        diff = (saved.double() - live.double()).abs().masked_fill(both_nan, 0).nan_to_num(float("inf")).max().item()
        return f"{where}: differs from the trained state (max abs difference {diff:.3g})"
    return None


def blank_like(tree):
    """An empty copy of a (possibly sharded) state dict to load a checkpoint into, so reading it
    back never writes into the live tensors."""
    if isinstance(tree, dict):
        return {k: blank_like(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(blank_like(v) for v in tree)
    return torch.empty_like(tree) if isinstance(tree, torch.Tensor) else tree


def read_back(path: Path):
    """torch.load of a file this run just wrote (trusted: it holds optimizer objects, not only
    tensors), memory-mapped so a large optimizer state is not held twice in host RAM."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def corrupt_checkpoint(folder: Path) -> None:
    """Test seam: TOOLKIT_FAULT_CORRUPT_CHECKPOINT=N changes the first tensor of step N's largest
    checkpoint file (weights or optimizer state) after it is written (the main process; before
    the read-back)."""
    step = os.environ.get("TOOLKIT_FAULT_CORRUPT_CHECKPOINT")
    if not step or not folder.name.endswith(f"step-{int(step):06d}"):
        return
    files = [f for f in folder.rglob("*") if f.is_file() and f.suffix in (".safetensors", ".bin", ".pt", ".distcp")]
    f = max(files, key=lambda f: f.stat().st_size)
    if f.suffix == ".safetensors":
        return inject_corruption(f.parent, force=True)
    if f.suffix == ".distcp":  # raw tensor bytes: change some in the middle
        with open(f, "r+b") as fh:
            fh.seek(f.stat().st_size // 2)
            chunk = fh.read(64)
            fh.seek(f.stat().st_size // 2)
            fh.write(bytes(b ^ 0x55 for b in chunk))
        return
    obj = torch.load(f, map_location="cpu", weights_only=False)

    def bump(tree) -> bool:
        items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
        for k, v in items:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                tree[k] = v + 1
                return True
            if bump(v):
                return True
        return False

    if not bump(obj):
        raise RuntimeError(f"test seam: {f} holds no tensor to change")
    torch.save(obj, f)
