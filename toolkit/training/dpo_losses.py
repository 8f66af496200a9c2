"""DPO's loss types, as TRL 1.16's DPOTrainer computes them (`DPOConfig.loss_type`, a name or a list of
names combined with `loss_weights`: TRL's MPO), on each completion's summed target log-probabilities
(`loss.token_logps`), their target counts and the reference's sums. `tests/test_dpo_losses.py` compares
each, and its gradient, with TRL's own `_compute_loss` on the same log-probabilities.

Per pair, with Δc = chosen - ref_chosen, Δr = rejected - ref_rejected and d = Δc - Δr:
`sigmoid` -log σ(βd) (smoothed by label_smoothing: conservative DPO, as TRL before 1.x; TRL 1.16 ignores
label_smoothing here), `hinge` relu(1 - βd), `ipo` (d' - 1/(2β))² with d' on per-token averages,
`exo_pair` EXO's KL to [1 - ε, ε] (ε = label_smoothing), `nca_pair`, `robust` (Robust DPO, ε the flip
rate), `bco_pair` (TRL 1.16's: -log σ(βΔc) - log σ(-βΔr), no running reward mean), `sppo_hard`, `aot`
and `aot_unpaired` (the sorted log-ratios of the micro-batch's pairs: a pair's loss depends on the
others of its micro-batch, as TRL's of its per-device batch), `apo_zero`, `apo_down`, `discopop`
(discopop_tau), `sft` (the chosen completion's NLL: averaged over each pair's own tokens here, where TRL
averages over the batch's chosen tokens: the same where the chosen completions are equally long, and
independent of the micro-batches), `sigmoid_norm` (-log σ(βd') on per-token averages).

`f_divergence_type` (f-DPO): the log-ratios Δ of the loss types built on d (F_DIVERGENCE_LOSS_TYPES) become
f'(e^Δ) of another divergence than the reverse KL, as TRL's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config.objectives import DPO_LOSS_TYPES as LOSS_TYPES
from ..config.objectives import DPO_OPTIONS, F_DIVERGENCE_LOSS_TYPES


def loss_types(loss_type: str | list[str]) -> list[str]:
    """preference.loss_type as a list (a name, or a list of names)."""
    return [loss_type] if isinstance(loss_type, str) else list(loss_type)


def f_scores(ratio: torch.Tensor, f_divergence_type: str, alpha: float) -> torch.Tensor:
    """A log-ratio Δ as f-DPO's score f'(e^Δ) (TRL 1.16's): reverse_kl Δ itself, forward_kl 1 - e^-Δ,
    js_divergence log 2 + log σ(Δ), alpha_divergence (e^((α-1)Δ) - 1)/(α-1) (clamped before exp, as TRL's)."""
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return ratio
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-ratio)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(ratio)
    if f_divergence_type == "alpha_divergence":
        t = (alpha - 1.0) * ratio
        clamped = torch.clamp(t.float(), max=11.0 if t.dtype == torch.float16 else 80.0)
        return (torch.exp(clamped) - 1.0).to(t.dtype) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}")


def sorted_among(values: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """`values` sorted ascending among the `valid` pairs (their places, in order), the others as they are."""
    if valid is None or bool(valid.all()):
        return torch.sort(values, dim=0)[0]
    index = valid.nonzero()[:, 0]
    return values.index_put((index,), torch.sort(values[index], dim=0)[0])


def dpo_loss(loss_type: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_n: torch.Tensor,
             rejected_n: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, beta: float,
             label_smoothing: float = 0.0, discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl",
             f_alpha_divergence_coef: float = 0.5, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per pair: the loss of one of TRL 1.16's DPO `loss_type`s (LOSS_TYPES). `valid`: the pairs that count
    (aot and aot_unpaired sort among them only)."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if f_divergence_type != "reverse_kl" and loss_type not in F_DIVERGENCE_LOSS_TYPES:
        raise ValueError(f"f_divergence_type {f_divergence_type} is not defined for loss_type {loss_type}")
    chosen_score = f_scores(chosen_ratio, f_divergence_type, f_alpha_divergence_coef)
    rejected_score = f_scores(rejected_ratio, f_divergence_type, f_alpha_divergence_coef)
    d = chosen_score - rejected_score
    eps = label_smoothing
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type in ("ipo", "sigmoid_norm"):
        average = chosen_score / chosen_n - rejected_score / rejected_n
        return (average - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * average)
    if loss_type == "exo_pair":
        return (torch.sigmoid(beta * d) * (F.logsigmoid(beta * d) - math.log1p(-eps))
                + torch.sigmoid(-beta * d) * (F.logsigmoid(-beta * d) - math.log(eps)))
    if loss_type == "nca_pair":
        return (-F.logsigmoid(beta * chosen_ratio) - 0.5 * F.logsigmoid(-beta * chosen_ratio)
                - 0.5 * F.logsigmoid(-beta * rejected_ratio))
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if loss_type == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            delta = sorted_among(chosen - rejected, valid) - sorted_among(ref_chosen - ref_rejected, valid)
        else:
            delta = sorted_among(chosen_ratio, valid) - sorted_among(rejected_ratio, valid)
        return -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss_type == "discopop":
        logits = beta * d
        modulation = torch.sigmoid(logits / discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    if loss_type == "sft":
        return -chosen / chosen_n
    raise ValueError(f"unknown DPO loss_type {loss_type!r}; one of {', '.join(LOSS_TYPES)}")


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, chosen_n: torch.Tensor, rejected_n: torch.Tensor,
               ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, beta: float,
               loss_type: str | list[str] = "sigmoid", loss_weights: list[float] | None = None,
               label_smoothing: float = 0.0, discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl",
               f_alpha_divergence_coef: float = 0.5, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per pair: the weighted sum of the loss types' losses (`loss_weights`, each 1.0 where None), so that
    their mean over pairs is TRL's Σ weight x mean loss."""
    names = loss_types(loss_type)
    weights = [1.0] * len(names) if loss_weights is None else loss_weights
    total = None
    for name, weight in zip(names, weights, strict=True):
        term = weight * dpo_loss(name, chosen, rejected, chosen_n, rejected_n, ref_chosen, ref_rejected, beta=beta,
                                 label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                                 f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                                 valid=valid)
        total = term if total is None else total + term
    return total


def options(cfg) -> dict:
    """The keys of the preference section that DPO's loss types take (config/objectives.DPO_OPTIONS), as dpo_losses'
    keywords."""
    return {name: getattr(cfg, name) for name in DPO_OPTIONS}


def described(cfg) -> list[str]:
    """The start-of-run words of DPO's loss: its loss types (and their weights) first, then the keys they use that
    are not their defaults."""
    weights = f" x {', '.join(f'{w:g}' for w in cfg.loss_weights)}" if cfg.loss_weights else ""
    return [f"loss_type {'+'.join(loss_types(cfg.loss_type))}{weights}"] \
        + ([f"discopop_tau {cfg.discopop_tau:g}"] if "discopop" in loss_types(cfg.loss_type) else []) \
        + ([f"f_divergence_type {cfg.f_divergence_type}"] if cfg.f_divergence_type != "reverse_kl" else []) \
        + ([f"f_alpha_divergence_coef {cfg.f_alpha_divergence_coef:g}"]
           if cfg.f_divergence_type == "alpha_divergence" else [])
