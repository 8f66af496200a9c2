"""`model.attn_implementation: varlen`: attention over packed documents without a mask.

Packed rows and padding-free micro-batches (`data.padding_free`) say where each document starts by
`position_ids` that restart at 0. With `sdpa` or `eager`, transformers turns that into a dense
block-diagonal mask over the whole row (rows x length^2, and no flash kernel). This attention reads
the document bounds instead (`cu_seq_lens_q` and `max_length_q`, computed on the host by the
collator, or from `position_ids`) and attends within each document only:

- on CUDA in bf16/fp16 (16-bit tensors, or fp32 ones under 16-bit autocast, cast as SDPA casts them), with
  PyTorch's flash-attention varlen kernel (`torch.nn.attention.varlen.varlen_attn`): no mask, no padding,
  nothing computed across documents;
- elsewhere (CPU, fp32, attention dropout) with one causal SDPA call per document: the same result,
  slower.

Anything else (a padding mask, generation with a KV cache) goes to transformers' SDPA unchanged, so
a model set up this way still generates and evaluates as before; saved configs do not record it.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ToolkitError

NAME = "toolkit_varlen"


def register() -> None:
    """Make NAME a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)


def document_bounds(position_ids: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens, longest document) of a batch whose documents start where `position_ids` is 0,
    rows read one after another (a packed row's padding is one more document)."""
    pos = np.asarray(position_ids).reshape(-1)
    starts = np.flatnonzero(pos == 0)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    cu = np.append(starts, len(pos)).astype(np.int32)
    return torch.from_numpy(cu), int(np.diff(cu).max())


@torch.compiler.disable
def bounds_of(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    return document_bounds(position_ids.cpu().numpy())


def check_model(model: torch.nn.Module) -> None:
    """Refuse, in one line, models whose attention does more than causal softmax attention."""
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window or any(getattr(m, "sliding_window", None) for m in model.modules()):
        raise ToolkitError(f"model.attn_implementation: varlen does not do the sliding-window attention of {kind}; "
                           "use flash_attention_2, or sdpa with data.padding_free=false")
    if getattr(config, "attn_logit_softcapping", None):
        raise ToolkitError(f"model.attn_implementation: varlen does not do the attention softcapping of {kind}; "
                           "use eager, with data.padding_free=false")
    if any(getattr(m, "is_causal", True) is False for m in model.modules() if hasattr(m, "is_causal")):
        raise ToolkitError(f"model.attn_implementation: varlen is causal attention; {kind} has non-causal layers")


def mask(*, batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """No mask where `attention` needs none (a forward over whole rows without padding); SDPA's
    otherwise."""
    if attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """query (batch, heads, length, dim), key/value (batch, kv heads, length, dim) ->
    (batch, length, heads, dim), None, as transformers' attention functions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if attention_mask is not None or key.shape[2] != length or (cu is None and kwargs.get("position_ids") is None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if cu is None:  # a forward without the collator's bounds (checks, generation's prefill): one sync
        cu, longest = bounds_of(kwargs["position_ids"].expand(batch, length))
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value))
    gqa = k.shape[1] != heads
    autocast = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None
    if (half := flash_dtype(q.device.type, q.dtype, dropout, autocast)) is not None:
        from torch.nn.attention.varlen import varlen_attn

        count("flash")
        cu = cu.to(q.device, torch.int32, non_blocking=True)
        q, k, v = (x.to(half) for x in (q, k, v))  # as SDPA under autocast: it computes in the autocast dtype
        if gqa and not takes_gqa(varlen_attn):  # torch < 2.12's kernel: the key/value heads repeated
            k, v, gqa = *(x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v)), False
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=(-1, 0),
                          **({"enable_gqa": True} if gqa else {}))
    else:
        count("per_document")
        out = per_document(q, k, v, cu, dropout, scaling, gqa)
    return out.view(batch, length, heads, dim), None


@functools.cache
def takes_gqa(kernel) -> bool:
    return "enable_gqa" in inspect.signature(kernel).parameters


# How often each path ran in this process, outside torch.compile (tests/test_gpu.py checks that bf16 training takes
# the flash kernel); under train.compile nothing is counted, so the compiled graph has no side effect.
KERNEL_CALLS = {"flash": 0, "per_document": 0}


def count(path: str) -> None:
    if not torch.compiler.is_compiling():
        KERNEL_CALLS[path] += 1


def flash_dtype(device_type: str, dtype: torch.dtype, dropout: float,
                autocast: torch.dtype | None) -> torch.dtype | None:
    """The 16-bit dtype the flash varlen kernel runs in, or None where it cannot run (not CUDA, attention
    dropout, fp32 without autocast). Under bf16/fp16 autocast the query arrives in fp32 from a model
    with fp32 weights (Llama's rotary embedding multiplies the 16-bit projection by fp32 cos/sin, and
    type promotion wins), so the autocast dtype decides, as it does for SDPA. Before this, bf16 training
    of fp32 weights took the per-document loop: on the H200 the ~1B benchmark ran at 0.27x a hand-written
    loop, host-bound (benchmarks/NOTES.md)."""
    if device_type != "cuda" or dropout != 0.0:
        return None
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    return autocast if autocast in (torch.float16, torch.bfloat16) else None


@torch.compiler.disable  # a Python loop over documents: train.compile compiles around it
def per_document(q, k, v, cu, dropout, scaling, gqa):
    bounds = cu.tolist()
    return torch.cat([
        F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None],
            dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)[0].transpose(0, 1)
        for s, e in zip(bounds[:-1], bounds[1:])])
