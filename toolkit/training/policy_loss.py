"""The online-RL losses: the GRPO family (GRPO, DAPO, Dr. GRPO, CISPO; GSPO with sequence-level importance
sampling; INTELLECT-2's two-sided clipping by `delta`) and RLOO's, as pure tensor math: per-token
log-probabilities in, loss out; no model, no generation.

It is TRL 1.16's `GRPOTrainer._compute_loss` with TRL's defaults for what is not a parameter here
(no off-policy mask, no entropy bonus, and `use_bias_correction_kl=True`: the KL term is weighted by the
importance ratio); `sampler_weights` is its vLLM importance-sampling correction (`inputs["importance_sampling_
ratio"]`), made by `sampler_correction` from the sampler's log-probabilities as TRL makes it,
and `group_advantages` is the advantage of `_generate_and_score_completions`. tests/test_policy_loss.py
calls TRL's own code on the same tensors and checks the loss, its gradient and the metrics.
`leave_one_out_advantages` and `rloo_loss` are TRL 1.16's RLOOTrainer's advantages and `_compute_loss`.

The loss comes back as a sum over units plus their number, not as a mean, so that the caller divides
by the count over all micro-batches and ranks: one micro-batch on one process gives TRL's loss.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo")
SAMPLER_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TOKEN_MEAN = ("dapo", "cispo")  # averaged over every completion token of the global batch
IMPORTANCE_SAMPLING = ("token", "sequence")
SCALES = ("group", "batch", "none")
STD_EPSILON = 1e-4  # TRL's: advantages / (std + 1e-4)
QUANTILE_LIMIT = 2 ** 24  # the most elements torch.quantile takes


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str, batch_std: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages of `rewards` (n_prompts * group_size,), each prompt's completions contiguous: the reward
    minus its group's mean, divided by (std + 1e-4) with the unbiased std of the group (`scale="group"`)
    or of the whole global batch (`"batch"`: `batch_std`, computed over every rank's rewards by the caller;
    None: `rewards.std()`), not divided for `"none"`. A group of equal rewards gets zeros."""
    if scale not in SCALES:
        raise ValueError(f"scale: {scale!r}; one of {', '.join(SCALES)}")
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.nanmean(dim=1, keepdim=True)).view(-1)  # NaN: unscorable, left out (as TRL)
    if scale == "group":
        advantages = advantages / (nanstd(grouped).repeat_interleave(group_size) + STD_EPSILON)
    elif scale == "batch":
        advantages = advantages / ((nanstd(rewards[None])[0] if batch_std is None else batch_std) + STD_EPSILON)
    # a std over one reward is NaN, and so is an unscorable completion: TRL zeroes those advantages in every mode
    return torch.nan_to_num(advantages, nan=0.0)


def nanstd(x: torch.Tensor) -> torch.Tensor:
    """The unbiased std of each row of `x`, NaN left out (TRL's nanstd)."""
    n = (~x.isnan()).sum(dim=1)
    variance = ((x - x.nanmean(dim=1, keepdim=True)) ** 2).nansum(dim=1) / (n - 1)
    return variance.sqrt()


def sampler_correction(old_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                    clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling correction (`vllm_importance_sampling_mode` and its clip bounds): the
    ratio of the trained model's probability of each sampled token (`old_logps`, no gradient) to the sampler's
    (`sampler_logps`, what an inference server reported; NaN where it reported none: ratio 1), per token (B, T)
    or per completion (B, 1, the sum of its tokens' log-ratios); `*_truncate` clamps it to [clip_min, clip_max],
    `*_mask` sets it to 0 outside them (a bound of None: none on that side)."""
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"mode: {mode!r}; one of {', '.join(SAMPLER_CORRECTIONS)}")
    diff = torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -float("inf") if clip_min is None else clip_min
    high = float("inf") if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    importance_sampling: str,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    max_completion_length: int,
    delta: float | None = None,
    entropy_mask: torch.Tensor | None = None,
    sampler_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """The clipped-surrogate loss (plus `beta` x KL to the reference) of a micro-batch of B completions.

    logps, old_logps, ref_logps: (B, T) log-probabilities of the completion tokens under the policy (with
    its gradient), the policy that sampled them (None: `logps` detached, i.e. one iteration per batch) and
    the reference (needed iff beta > 0); advantages: (B,); mask: (B, T), 1.0 on completion tokens;
    entropy_mask: (B, T) bool, the tokens whose policy term counts (TRL's top_entropy_quantile; None: all);
    sampler_weights: (B, T) or (B, 1) from `sampler_correction`, multiplying the policy term (not the KL), as TRL's
    vLLM importance-sampling correction (None: completions sampled by the trained model itself).

    Returns (loss_sum, units, metric_sums); loss_sum / units is TRL's loss of this micro-batch:
      dapo, cispo: the sum of per-token losses over the mask.sum() tokens;
      grpo: the sum over the B completions of the mean of its per-token losses;
      dr_grpo: the sum of per-token losses / max_completion_length, over B units.
    metric_sums (detached float64 sums): "clip_ratio_low", "clip_ratio_high", "clip_ratio" (the low, high
    and either region where the clipped term is taken, as TRL's clip_ratio/{low,high,region}_mean) over
    "clip_units" (TRL's denominator: the tokens, or the completions under sequence-level sampling; under
    cispo "clip_ratio_high" and "clip_ratio" count the weights capped at epsilon_high, TRL's cispo_clip_ratio),
    "kl" (only when beta > 0) over "tokens".
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: {loss_type!r}; one of {', '.join(LOSS_TYPES)}")
    if old_logps is None:
        old_logps = logps.detach()
    log_ratio = logps - old_logps
    if importance_sampling == "token":
        log_weights = log_ratio
    elif importance_sampling == "sequence":  # GSPO: one ratio per completion, the mean log-ratio of its tokens
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"importance_sampling: {importance_sampling!r}; one of {', '.join(IMPORTANCE_SAMPLING)}")
    ratio = torch.exp(log_weights)  # (B, T), or (B, 1) at sequence level
    advantages = advantages.unsqueeze(1)
    if loss_type == "cispo":  # the weight clipped and its gradient stopped; the gradient is the log-probability's
        per_token_loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)  # two-sided (TRL clamps after coef_2)
        per_token_loss = -torch.min(unclipped * advantages, clipped * advantages)
    if entropy_mask is not None:  # before the KL term, as TRL: the KL still counts on every token
        per_token_loss = per_token_loss * entropy_mask
    if sampler_weights is not None:  # the inference server's sampling corrected, before the KL term, as TRL
        per_token_loss = per_token_loss * sampler_weights
    if beta != 0.0:
        ref_minus_policy = ref_logps - logps
        # k3 estimator of KL(policy || ref), times the ratio: TRL's use_bias_correction_kl (on by default)
        per_token_kl = (torch.exp(ref_minus_policy) - ref_minus_policy - 1) * ratio
        per_token_loss = per_token_loss + beta * per_token_kl
    masked_loss = per_token_loss * mask  # also spreads a (B, 1) sequence-level loss over the tokens

    tokens = mask.sum()
    if loss_type in TOKEN_MEAN:
        loss_sum, units = masked_loss.sum(), int(tokens.item())
    elif loss_type == "grpo":
        loss_sum, units = (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), logps.size(0)
    else:
        loss_sum, units = masked_loss.sum() / max_completion_length, logps.size(0)

    # TRL counts clipping per token, or per completion where the ratio has one column (sequence level)
    if loss_type == "cispo":
        low, high = torch.zeros_like(ratio, dtype=torch.bool), (ratio > epsilon_high) & (advantages > 0)
    else:
        counted = ratio if delta is None else torch.clamp(ratio, max=delta)  # TRL counts after the delta clamp
        low, high = (counted < 1 - epsilon) & (advantages < 0), (counted > 1 + epsilon_high) & (advantages > 0)
    weight = mask if ratio.size(1) > 1 else torch.ones_like(ratio)
    metric_sums = {
        "clip_ratio_low": (low * weight).sum(),
        "clip_ratio_high": (high * weight).sum(),
        "clip_ratio": ((low | high) * weight).sum(),
        "clip_units": weight.sum(),
        "tokens": tokens,
    }
    if beta != 0.0:
        metric_sums["kl"] = (per_token_kl * mask).sum()
    metric_sums = {name: value.detach().double() for name, value in metric_sums.items()}
    return loss_sum, units, metric_sums


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy at or above which a token is among the top `quantile` of `entropies` (the completion tokens'
    entropies, flat): TRL's get_high_entropy_mask threshold, torch.quantile at 1 - quantile in float32. None
    given: +inf (no token)."""
    if entropies.numel() == 0:
        return torch.tensor(float("inf"))
    values = entropies.float()
    if values.numel() <= QUANTILE_LIMIT:
        return torch.quantile(values, 1 - quantile)
    # torch.quantile refuses more elements; its linear interpolation between the two nearest order statistics
    ordered = values.sort().values
    position = (1 - quantile) * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    return torch.lerp(ordered[low], ordered[high], torch.tensor(position - low, dtype=ordered.dtype))


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the completion tokens whose entropy is at least `threshold` (TRL's comparison)."""
    return ((entropies * mask.float()) >= threshold) & mask.bool()


# --- RLOO (TRL 1.16's RLOOTrainer)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int, moments: tuple | None = None,
                             normalize: bool = False) -> torch.Tensor:
    """RLOO's advantages of `rewards` (n_prompts * group_size,), each prompt's completions contiguous: the reward
    minus the mean of its group's other scored rewards (TRL's leave-one-out baseline; NaN rewards, unscorable, left
    out); `normalize`: then minus their mean over the batch, divided by their std + 1e-4, the mean and unbiased std
    given as `moments` (over every rank, by the caller) or taken here. A group with one scored completion and an
    unscorable completion get 0."""
    advantages = leave_one_out(rewards, group_size)
    if normalize:
        mean, std = moments if moments is not None else (advantages.nanmean(), nanstd(advantages[None])[0])
        advantages = (advantages - mean) / (std + STD_EPSILON)
    return torch.nan_to_num(advantages, nan=0.0)


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward minus the mean of its group's other scored rewards; NaN where unscorable or alone."""
    grouped = rewards.view(-1, group_size)
    scored = (~grouped.isnan()).sum(dim=1, keepdim=True)
    return rewards - ((grouped.nansum(dim=1, keepdim=True) - grouped) / (scored - 1)).view(-1)


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              epsilon: float, epsilon_high: float, sampler_weights: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """TRL's RLOO `_compute_loss` of a micro-batch of B completions: one ratio per completion, of its summed
    log-probability (the product of its tokens' ratios), clipped as PPO's; the loss a sum over the B completions
    (TRL's is their mean: one micro-batch on one process gives TRL's loss). Metric sums as `policy_loss`'s, clipping
    counted per completion. `sampler_weights` (B, 1), from `sampler_correction` in a sequence mode: each
    completion's term weighted by it (rl.sampler vllm; TRL's RLOO has no such correction)."""
    sequence = (logps * mask).sum(-1)
    old = sequence.detach() if old_logps is None else (old_logps * mask).sum(-1)
    ratio = torch.exp(sequence - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if sampler_weights is not None:
        loss = loss * sampler_weights.reshape(-1)
    low, high = (ratio < 1 - epsilon) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
    sums = {"clip_ratio_low": low.sum(), "clip_ratio_high": high.sum(), "clip_ratio": (low | high).sum(),
            "clip_units": torch.tensor(float(logps.size(0))), "tokens": mask.sum()}
    return loss.sum(), logps.size(0), {name: value.detach().double() for name, value in sums.items()}
