"""DeepSpeed's compiled ops: which a launch needs (CPU Adam for an optimizer offload, async_io for NVMe, FusedAdam
for a DeepSpeed JSON's Adam on CUDA) and whether each is built, found without compiling it (minutes). `toolkit
doctor` reports them; a run says, before it waits minutes on a first build, that it is compiling and that it
happens once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

OP_BUILDERS = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder", "fused_adam": "FusedAdamBuilder"}
OP_HINTS = {
    "cpu_adam": "DeepSpeed's CPU Adam (optimizer offload) needs a C++ compiler (g++) and ninja",
    "async_io": "DeepSpeed's async_io (NVMe offload) needs libaio: apt install libaio-dev",
    "fused_adam": "DeepSpeed's FusedAdam needs the CUDA toolkit (nvcc) and ninja",
    "lock": "a build was killed midway; remove the lock file, or every launch waits on it forever",
}


def needed_ops(zero: dict, optimizer: dict | None = None, cuda: bool = False) -> list[str]:
    """DeepSpeed ops the config compiles at first use: CPU Adam for an optimizer offload, async_io for NVMe,
    FusedAdam for the JSON's own Adam or AdamW on CUDA (`optimizer`: its optimizer block)."""
    device = {part: (zero.get(f"offload_{part}") or {}).get("device", "none") for part in ("optimizer", "param")}
    offload = device["optimizer"] in ("cpu", "nvme")
    fused = cuda and not offload and str((optimizer or {}).get("type", "")).lower() in ("adam", "adamw")
    return ["cpu_adam"] * offload + ["async_io"] * ("nvme" in device.values()) + ["fused_adam"] * fused


def op_status(op: str) -> tuple[bool, str, str | None]:
    """Whether DeepSpeed can load `op` now: (ok, text, hint), found without compiling it (minutes)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import get_default_build_root

    builder = get_accelerator().create_op_builder(OP_BUILDERS[op])
    if builder is None or not builder.is_compatible():
        return False, "cannot be built on this host", OP_HINTS[op]
    if installed_ops.get(builder.name):
        return True, "compatible, prebuilt in the deepspeed install", None
    root = os.environ.get("TORCH_EXTENSIONS_DIR")  # where torch's JIT build puts it (cpp_extension)
    if root is None:
        flavour = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}")
    folder = Path(root) / builder.name
    if any(folder.glob(f"{builder.name}*.so")):
        return True, f"compatible, built ({folder})", None
    if (folder / "lock").exists():
        return False, f"{folder / 'lock'} is left from an unfinished build", OP_HINTS["lock"]
    return True, (f"compatible, not built: the first launch compiles it (minutes); to build it beforehand: python -c "
                  f"\"from deepspeed.ops.op_builder import {OP_BUILDERS[op]} as B; B().load()\""), None
