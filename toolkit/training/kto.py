"""KTO (Kahneman-Tversky Optimization), TRL 1.16's KTOTrainer as an objective of the loop
(preference.method=kto, data.format=unpaired): each row is one completion, desirable or not.

Per completion, with r = β (log π(y|x) - log π_ref(y|x)) its implied reward and z the KL estimate:
desirable: desirable_weight x (1 - σ(r - βz)); undesirable: undesirable_weight x (1 - σ(βz - r))
(loss_type=apo_zero_unpaired: 1 - σ(r) and σ(r), no z). The loss is a mean over the global batch's
completions.

z is TRL's estimate from mismatched pairs: each completion's prompt followed by another row's
completion as written, cut with this prompt at data.max_seq_len (`batching.Examples`: the nearest
earlier row's in the prepared data whose prompt differs, as TRL rotates completions by one), log π -
log π_ref summed over those completion tokens, averaged, clamped at 0 and without gradient. TRL
averages it over one micro-batch (then over ranks) of consecutive rows (it needs sequential
sampling), so its figure changes with the micro-batch size and the number of processes; here
`step_batches` averages it over the whole global batch (every micro-batch, every rank) before the
step's first loss, and evaluation over the whole eval set, so what is learned is the same on every
layout, with shuffled batches. The two are the same number where a batch is the data's rows in
order, one micro-batch on one process (the data of tests/test_kto.py's comparison is one such
batch).

The reference is DPO's (`reference.py`): precomputed for full fine-tuning, the disabled adapter
for LoRA; a batch that brings none is refused as DPO's (`objectives.no_reference`). Rows all of one
label, or weights out of the KTO paper's range for their balance, are said at start
(`label_balance`, as TRL warns).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .loss import token_logps
from .objectives import KL_ESTIMATE, Objective, Preparation, no_reference, sequences_with_targets

KL_PREFIX = "kl_"
NOT_MODEL_INPUTS = ("kto_labels", "reference_logps")


def completion_part(batch: dict) -> dict:
    """The completions' batch: the keys that are not the mismatched sequences' (`kl_*`) or labels."""
    return {k: v for k, v in batch.items() if not k.startswith(KL_PREFIX) and k not in NOT_MODEL_INPUTS}


def mismatched_part(batch: dict) -> dict:
    """The mismatched sequences' batch (`kl_*`, the prefix taken off)."""
    return {k[len(KL_PREFIX):]: v for k, v in batch.items() if k.startswith(KL_PREFIX)}


def kto_losses(logratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float, *, beta: float,
               loss_type: str = "kto", desirable_weight: float = 1.0, undesirable_weight: float = 1.0
               ) -> torch.Tensor:
    """Each completion's weighted loss from its log-ratio to the reference, as TRL's KTOTrainer:
    `kto`: 1 - σ(β(ratio - kl)) desirable, 1 - σ(β(kl - ratio)) undesirable; `apo_zero_unpaired`:
    1 - σ(β ratio) and σ(β ratio)."""
    if loss_type == "kto":
        up, down = 1 - F.sigmoid(beta * (logratios - kl)), 1 - F.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        up, down = 1 - F.sigmoid(beta * logratios), F.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    return torch.where(desirable, desirable_weight * up, undesirable_weight * down)


def label_balance(labels, cfg) -> list[str]:
    """The start-of-run warning for a training set whose desirable and undesirable rows (`labels`: 1
    and 0) leave half of the loss untrained or unweighted: one kind absent (each of its terms never
    trains), or, as TRL's KTOTrainer warns, the two in unequal numbers with neither weight in the KTO
    paper's range for them (its Eq. 8: desirable_weight x desirable rows within 1 to 1.33 x
    undesirable_weight x undesirable rows), its advice in its numbers. [] where neither holds."""
    labels = np.asarray(labels)
    n, up = len(labels), int(labels.sum())
    if n and up in (0, n):
        kind, other, label, raise_or_lower = (("desirable", "undesirable", "true", "raise") if up else
                                              ("undesirable", "desirable", "false", "lower"))
        return [f"every one of the {n} train rows is {kind} (label {label}), so the {other} half of KTO's loss never "
                f"trains: the model only learns to {raise_or_lower} these completions' rewards against the KL "
                f"estimate; add {other} rows (label {'false' if up else 'true'}) to teach it the difference"]
    down, dw, uw = n - up, cfg.desirable_weight, cfg.undesirable_weight
    if up == down:
        return []
    # TRL 1.16's bounds, rounded as it rounds them
    desirable = (round(down * uw / up, 2), round(down * uw / up * 1.33, 2))
    undesirable = (round(up * dw / down / 1.33, 2), round(up * dw / down, 2))
    if desirable[0] <= dw <= desirable[1] or undesirable[0] <= uw <= undesirable[1]:
        return []
    return [f"{up} desirable and {down} undesirable train rows, and neither preference.desirable_weight ({dw:g}) nor "
            f"preference.undesirable_weight ({uw:g}) is in the KTO paper's range for that balance (as TRL's "
            f"KTOTrainer warns): set EITHER preference.desirable_weight in [{desirable[0]}, {desirable[1]}] or "
            f"preference.undesirable_weight in [{undesirable[0]}, {undesirable[1]}] (not both)"]


def data_warnings(table, recipe) -> list[str]:
    """The start-of-run warnings of the prepared train rows (`table`): their labels' balance (`label_balance`)."""
    return label_balance(table.select_columns(["label"]).with_format("numpy")[:]["label"], recipe.preference)


def for_recipe(recipe, model=None, *, backend, **_) -> Unpaired:
    """KTO's objective for the built model: its KL estimate reduced over the backend's ranks; its reference the
    model with its adapter disabled where preference.reference is adapter."""
    return Unpaired(recipe.preference, backend.accelerator,
                    adapter=model if recipe.preference.reference == "adapter" else None)


class Unpaired(Objective):
    """KTO over unpaired completions (see the module). Logged: kl (the estimate z), rewards_chosen and
    rewards_rejected (the mean implied reward of the desirable and of the undesirable completions;
    absent from a step that has none) and reward_margin (their difference), as TRL's rewards/*."""

    unit = "completions"
    eval_metrics = ("kl", "rewards_chosen", "rewards_rejected", "reward_margin")
    SUMS = ("kl", "rewards_chosen", "rewards_rejected", "desirable", "undesirable")

    def __init__(self, cfg, accelerator=None, adapter=None):
        self.cfg, self.accelerator, self.adapter = cfg, accelerator, adapter
        self.uses_kl = cfg.loss_type == "kto"
        self.kl = 0.0
        self.sums: dict[str, torch.Tensor] = {}

    def describe(self) -> list[str]:
        p = self.cfg
        knobs = [f"beta {p.beta:g}", f"loss_type {p.loss_type}", f"desirable_weight {p.desirable_weight:g}",
                 f"undesirable_weight {p.undesirable_weight:g}"]
        kl = ("KL estimate from mismatched pairs (each prompt with the completion of the nearest earlier row with "
              "another prompt), averaged over the global batch" if self.uses_kl else "no KL estimate")
        where = ("the model with its LoRA adapter disabled" if p.reference == "adapter"
                 else "log-probabilities computed once with the starting weights, before step 1")
        return [f"preference: kto, {', '.join(knobs)}; {kl}; reference: {where}; the loss is a mean over completions"]

    def unsplittable(self) -> str | None:
        return "a completion's log-probability is taken on whole sequences, not on rows split across ranks"

    def units(self, batch: dict) -> int:
        return int(sequences_with_targets(completion_part(batch)).sum())

    def preparation(self) -> Preparation | None:
        return KL_ESTIMATE if self.uses_kl else None

    def step_batches(self, model, micro_batches: list[dict], step: int, later: list = ()) -> list[dict]:
        if self.uses_kl:
            self.kl = self.kl_estimate(model, micro_batches)
        return micro_batches

    def begin_eval(self, model, batches) -> None:
        if self.uses_kl:
            self.kl = self.kl_estimate(model, batches)

    def reference_logps(self, model, batch: dict, part: dict, half: int) -> torch.Tensor:
        """The reference's summed log-probability of each sequence of `part` (`half` 0: the
        completions, 1: the mismatched sequences)."""
        if "reference_logps" in batch:
            n = len(batch["reference_logps"]) // 2
            return batch["reference_logps"][half * n:(half + 1) * n]
        if self.adapter is None:  # precomputed: a batch without it is eval padding only, or refused (as DPO's)
            return no_reference("kto", part, len(batch["kto_labels"]))
        with torch.no_grad(), self.adapter.disable_adapter():
            return token_logps(model, part)[0]

    @torch.no_grad()
    def kl_estimate(self, model, batches) -> float:
        """The mean over `batches` (every rank's) of the mismatched sequences' log-ratio to the
        reference, clamped at 0, as TRL's (which takes it over one micro-batch)."""
        device = self.device(model)
        total = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in batches:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            part = mismatched_part(batch)
            logps, _ = token_logps(model, part)
            ratios = (logps - self.reference_logps(model, batch, part, 1).to(logps.dtype)).double()
            kept = sequences_with_targets(part) & sequences_with_targets(completion_part(batch))  # not eval padding
            total += torch.stack([ratios[kept].sum(), kept.sum().double()])
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, "sum")
        mean, n = total.tolist()
        return max(mean / n, 0.0) if n else 0.0

    def device(self, model) -> torch.device:
        return self.accelerator.device if self.accelerator is not None else next(model.parameters()).device

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        part = completion_part(batch)
        logps, _ = token_logps(model, part)
        reference = self.reference_logps(model, batch, part, 0).to(logps.dtype)
        desirable = batch["kto_labels"].to(logps.device)
        logratios = logps - reference
        p = self.cfg
        losses = kto_losses(logratios, desirable, self.kl, beta=p.beta, loss_type=p.loss_type,
                            desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
        valid = sequences_with_targets(part)
        kept = valid.double()
        rewards = p.beta * logratios.detach().double()
        up, down = kept * desirable.double(), kept * (~desirable).double()
        for name, value in zip(self.SUMS, (self.kl * kept, rewards * up, rewards * down, up, down)):
            self.sums[name] = self.sums.get(name, 0.0) + value.sum()
        return torch.where(valid, losses, torch.zeros_like(losses)).sum()

    def step_metrics(self, device) -> dict[str, torch.Tensor]:
        sums, self.sums = self.sums, {}
        return {name: torch.as_tensor(sums.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in self.SUMS}

    def finish_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """kl (the same on every completion), and the rewards of each kind averaged over its own
        completions; a kind the batch lacks is left out, and the margin with it."""
        out = {"kl": sums["kl"] / units if units else self.kl}
        for name, count in (("rewards_chosen", "desirable"), ("rewards_rejected", "undesirable")):
            if sums[count]:
                out[name] = sums[name] / sums[count]
        if "rewards_chosen" in out and "rewards_rejected" in out:
            out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        return out
