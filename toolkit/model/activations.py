"""Memory of long sequences: the MLP computed in tiles, and the activations autograd keeps for
backward moved to host memory (model.tiled_mlp, model.activation_offload).

Tiled MLP (the ALST recipe, as DeepSpeed's `TiledMLP`): each decoder layer's MLP runs over tiles of
about `hidden_size` positions (a count fixed for the run, see `tile_mlps`), each tile under a
non-reentrant checkpoint, so the MLP's intermediate
activations (4 x intermediate_size per token, the largest of a layer) exist for one tile at a time,
in forward and in backward's recompute. The weights' gradients of all tiles meet in one autograd
node before they are accumulated, so DDP, FSDP and ZeRO-3 see one gradient per step as without
tiling (DeepSpeed's own `TiledMLP` calls backward per tile and leaves DDP and FSDP to the caller).

Activation offload: the tensors autograd saves for backward, outside the checkpointed regions
(with model.gradient_checkpointing: each decoder layer's inputs, kept until backward reaches it),
are copied to (pinned) host memory when saved and back when backward needs them. Parameters and
tensors under 64 KiB stay where they are; a tensor saved by several layers (the rotary tables) is
copied once.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ToolkitError

MIN_OFFLOAD_BYTES = 64 << 10


def tile_mlps(model: torch.nn.Module, longest_row: int) -> tuple[int, int]:
    """model.tiled_mlp: every decoder layer's `mlp` runs as the same number of tiles along the
    positions, enough for the longest row the run can batch to be cut into tiles of hidden_size
    positions (ALST's size: a tile's intermediates are about one weight matrix). The count does not
    follow the batch: under ZeRO-3 a rank calling its MLP's layers more often than another would
    gather alone and hang. Returns (tiles per call, MLPs tiled); mixture-of-experts layers are refused."""
    text = model.config.get_text_config()
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp") and ".layers." in n]
    if any(hasattr(m, "experts") for m in mlps) or getattr(text, "num_local_experts", 0) \
            or getattr(text, "num_experts", 0):
        raise ToolkitError("model.tiled_mlp: for dense models; this one's MLPs are mixture-of-experts layers")
    if not mlps:
        raise ToolkitError(f"model.tiled_mlp: no decoder-layer MLP (a module named `mlp`) found in "
                           f"{type(model).__name__}")
    tiles = max(1, -(-longest_row // text.hidden_size))
    for module in mlps:
        if "forward" not in module.__dict__:
            module.forward = _tiled(module.forward, tiles)
    return tiles, len(mlps)


def _tiled(forward, tiles: int):
    def run(x, *args, **kwargs):
        if args or kwargs or x.dim() < 2 or tiles == 1:
            return forward(x, *args, **kwargs)
        parts = x.tensor_split(tiles, dim=-2)
        if torch.is_grad_enabled():
            outputs = [checkpoint(forward, t, use_reentrant=False) for t in parts]
        else:
            outputs = [forward(t) for t in parts]
        return torch.cat(outputs, dim=-2)

    return run


class Offload:
    """saved_tensors_hooks that keep large saved activations in host memory; `bytes` counts them.

    A tensor object saved several times (the rotary tables every layer saves) is copied once: the
    copies are indexed by the object's identity, and an entry goes when its tensor does. Not by
    its address: the GPU's caching allocator hands a freed tensor's memory to the next one of that
    size, and an address index then gave a later activation an earlier one's copy (the first GPU
    run of benchmarks/long_context.py, 2026-11-26: the losses of step 2 off by 16%)."""

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.min_bytes = min_bytes
        self.bytes = 0
        self._copies: dict[int, tuple] = {}

    def pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or t.numel() * t.element_size() < self.min_bytes:
            return t
        key = id(t)
        entry = self._copies.get(key)
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        host.copy_(t, non_blocking=t.is_cuda)
        packed = (t.device, host)
        copies = self._copies
        self._copies[key] = (weakref.ref(t, lambda _, key=key: copies.pop(key, None)), t._version, packed)
        self.bytes += host.numel() * host.element_size()
        return packed

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    @contextlib.contextmanager
    def __call__(self):
        self._copies = {}
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield
        self._copies = {}  # the graph holds the copies it needs; this index was for one forward


def offload(enabled: bool):
    """The context the forward runs in: offloading saved activations, or nothing."""
    return Offload() if enabled else contextlib.nullcontext
