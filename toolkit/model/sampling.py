"""Sampling completions inside training (online RL): a decoding loop with a KV cache over the
model's own forward, in which each completion draws from its own seeded generator.

`generate` (transformers) draws every row from one global random stream, so a completion would
depend on which rows share its batch, how many ranks split the batch, and what drew before it. Here
completion i draws only from `torch.Generator().manual_seed(seeds[i])` (one uniform number a token,
drawn on the host and moved to the model's device), from its own probabilities: the same seed and
logits give the same tokens whatever the batch, the backend, the number of ranks or a resume. The
logits, the draw and the tokens stay on the model's device; one flag a token (whether every row has
stopped) comes back to the host. `synced`: a callable that says whether every rank is done; a backend
whose forward is a collective (ZeRO-3 and FSDP gather each layer in it) needs all ranks to run the
same number of forward passes, so each keeps stepping until all are done.
"""

from __future__ import annotations

import hashlib
import inspect

import torch


def completion_seed(*parts: int) -> int:
    """A 63-bit seed from integers (the run's seed, the step, the prompt's source and row, the
    completion's index in its group): stable across processes and Python versions."""
    digest = hashlib.sha256("/".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def sample(model, prompts: list[list[int]], seeds: list[int] | None, *, max_new_tokens: int, stop_ids: list[int],
           pad_id: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float | None = None,
           repetition_penalty: float = 1.0, synced=None) -> list[list[int]]:
    """The completion of each prompt (token ids, its stop token included where it stopped). `seeds`:
    one per prompt; None: greedy. `model`: the module itself (not a DDP or DeepSpeed wrapper).
    `repetition_penalty`: each row's tokens seen so far (its prompt's and completion's, not padding)
    penalised as transformers' RepetitionPenaltyLogitsProcessor does, before the cuts."""
    device = next(model.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends where its completion starts
        ids[i, width - len(p):] = torch.as_tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator().manual_seed(s) for s in seeds] if seeds is not None else None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes keywords through
    taken = inspect.signature(type(base).forward).parameters
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in taken else {}
    cache_key = "cache" if "cache" in taken else "past_key_values"  # transformers 5.x renamed it
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    cache, step_ids = None, ids
    seen = None  # repetition_penalty: (rows, vocabulary) counts of the tokens each row holds, on the device
    for t in range(max_new_tokens):
        result = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       **{cache_key: cache}, **keep_last)
        cache = result.past_key_values
        logits = result.logits[:, -1].float()
        if repetition_penalty != 1.0:
            if seen is None:  # the logits' width: a sharded output layer's weight does not show it
                seen = torch.zeros(logits.shape, dtype=torch.int32, device=device)
                seen.scatter_add_(1, ids, mask.to(torch.int32))  # a repeated index adds; padding adds 0
            logits = penalised(logits, seen > 0, repetition_penalty)
        chosen = pick(logits, generators, temperature, top_p, top_k, min_p)
        chosen[done] = pad_id
        if seen is not None:
            seen.scatter_add_(1, chosen[:, None], (~done[:, None]).to(torch.int32))
        out[:, t] = chosen
        lengths += ~done
        done |= torch.isin(chosen, stops)
        if synced(bool(done.all())) if synced is not None else bool(done.all()):
            break
        step_ids = chosen[:, None]
        mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
    out, lengths = out.cpu(), lengths.cpu()
    return [out[i, :int(lengths[i])].tolist() for i in range(n)]


def penalised(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The logits of tokens already seen divided by `penalty` where positive, multiplied where negative
    (transformers' RepetitionPenaltyLogitsProcessor, TRL's repetition_penalty)."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def pick(logits: torch.Tensor, generators: list[torch.Generator] | None, temperature: float,
         top_p: float, top_k: int = 0, min_p: float | None = None) -> torch.Tensor:
    """The next token of each row: the most likely (no generators), or drawn with row i's generator
    from its `warped` logits."""
    if generators is None:
        return logits.argmax(-1)
    logits = warped(logits, temperature, top_p, top_k, min_p)
    # Inverse CDF: one uniform number from each row's own generator, one batched search (a multinomial
    # call per row per token took 3x the time of the whole draw; benchmarks/grpo_speed.py).
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=cdf.dtype) for g in generators]).to(cdf.device)
    chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return chosen.clamp(max=cdf.shape[-1] - 1)  # a token of probability 0 is never chosen


def warped(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
           min_p: float | None = None) -> torch.Tensor:
    """logits / temperature, cut (-inf) to the top_k most likely, to the nucleus top_p and to min_p x the
    most likely's probability: transformers' Temperature, TopK, TopP and MinP warpers, in their order, as
    TRL's generation applies them (tests/test_sampling.py compares them)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1, None], float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        cut = ordered.softmax(-1).cumsum(-1) <= (1 - top_p)
        cut[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(cut.scatter(1, order, cut), float("-inf"))
    if min_p is not None:
        probs = logits.softmax(-1)
        low = probs < min_p * probs.amax(-1, keepdim=True)
        low.scatter_(-1, probs.argmax(-1, keepdim=True), False)  # the most likely token always stays
        logits = logits.masked_fill(low, float("-inf"))
    return logits
