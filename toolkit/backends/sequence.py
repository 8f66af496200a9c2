"""Sequence parallelism: the data side.

An accelerate config with `parallelism_config_sp_size: N` (and `sp_backend: deepspeed`) makes
accelerate's `prepare` register DeepSpeed's Ulysses attention in the model and give DeepSpeed its
groups: ranks 0..N-1 share one sequence, N..2N-1 the next, and gradients are summed over a group
and averaged over the world / N data-parallel groups. accelerate splits only the DataLoaders handed
to `prepare`, and the loop hands it none, so the split is here:

- the N ranks of a group load the same rows (the sampler is sharded over rank // N of world // N);
- the collator pads each row to a multiple of N (`Collator(multiple=N)`);
- `shard` keeps this rank's N-th of every row. Attention gathers the whole sequence (an all-to-all
  over the group, each rank a share of the heads), so the document bounds of packed and
  padding-free rows stay those of the whole row, and `position_ids` are the row's own;
- the last position of a part predicts the first token of the next part, so the labels are shifted
  on the whole row first (`shift_labels`: position i's target) and the loss takes them as they are.

Each rank's loss is the sum over its part's targets; summed over the group it is the row's, so the
learning is the unsplit run's.
"""

from __future__ import annotations

import torch

from ..data.formats import IGNORE
from ..errors import ToolkitError


def shard(batch: dict, rank: int, size: int) -> dict:
    """Rank `rank`'s part (of `size`) of a collated batch whose rows are a multiple of `size` long:
    every per-position tensor cut to its part, `labels` replaced by that part's `shift_labels`.
    The attention mask is dropped: rows are right-padded and attention is causal, so no real token
    sees padding without it (Ulysses drops masks in any case; a mask of the part would be wrong)."""
    if size == 1:
        return batch
    labels = batch["labels"]
    rows, length = labels.shape
    if length % size:
        raise ValueError(f"a row of {length} positions does not split into {size} equal parts")
    part = length // size
    out = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask")}
    out.setdefault("position_ids", torch.arange(length).expand(rows, length))
    shifted = torch.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    out["shift_labels"] = shifted
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.shape == (rows, length):
            out[key] = value[:, rank * part:(rank + 1) * part].contiguous()
    return out


def attention_heads(config) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config (its text model's)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def check_heads(sp: int, heads: int, kv_heads: int, source: str) -> None:
    """Ulysses gives each rank of a group of `sp` a share of the attention heads (key/value heads
    repeated up to `sp` where there are fewer). The one judge of a split of these heads: the launch
    (`DeepSpeed.check_model`) and the verbs that plan one (`toolkit config show`, `toolkit estimate`)
    all ask here, so a plan never promises a split the launch refuses (tests/test_planning_agrees.py)."""
    if heads % sp or not (kv_heads % sp == 0 or sp % kv_heads == 0):
        raise ToolkitError(f"{source}: parallelism_config_sp_size is {sp} but the model has {heads} attention heads "
                           f"and {kv_heads} key/value heads; sp_size must divide the heads (and divide or be a "
                           "multiple of the key/value heads)")


def follow_rows(attn_implementation: str) -> None:
    """DeepSpeed's Ulysses attention fixes the rows of a micro-batch when accelerate registers it
    (train.micro_batch_size); a padding-free micro-batch is one row. Make the registered one take
    each call's rows from its query (its sequence length it already takes so)."""
    import inspect

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses = inspect.getclosurevars(ALL_ATTENTION_FUNCTIONS[attn_implementation]).nonlocals["uattn"]
    if not getattr(ulysses, "disable_in_eval", False):  # eval and generation run on whole rows, unsplit
        raise ToolkitError("launch: this DeepSpeed's Ulysses attention splits eval and generation too (no "
                           "disable_in_eval); use the DeepSpeed and accelerate of constraints.txt")
    forward = ulysses.forward

    def rows_of_the_call(module, query, *args, **kwargs):
        rows = query.shape[0]
        if rows != ulysses.batch_size:
            ulysses.batch_size = rows
            for name in ("required_query_shape", "required_key_value_shape", "required_context_shape"):
                shape = list(getattr(ulysses, name))
                shape[1] = rows
                setattr(ulysses, name, torch.Size(shape))
        return forward(module, query, *args, **kwargs)

    ulysses.forward = rows_of_the_call
