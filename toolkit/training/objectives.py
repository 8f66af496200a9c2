"""What a batch is trained to do: the loss of a batch and what it is normalised by. The loop asks
its objective through one typed contract, `Objective`, and knows nothing else about the loss, so
another objective is a class here, not branches in the loop.

Four implement it: `Supervised` (units: target tokens) and `Preference` (units: pairs) here, KTO's
`kto.Unpaired` (units: completions), which takes its KL estimate over the global batch in
`step_batches`, and online RL's `online.GroupRL` (units: completion tokens or completions), which
makes its own batch in `step_batches` (called once per optimizer step on the micro-batches the
loader gave, before anything is counted): it samples completions for the loader's prompts and scores
them before the loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ..data.formats import IGNORE
from ..errors import ToolkitError
from ..observe import measure
from .dpo_losses import described as dpo_losses_described
from .dpo_losses import dpo_losses
from .dpo_losses import options as dpo_options
from .loss import has_router, sequence_index, token_logps, token_loss_sum


@dataclass(frozen=True)
class Preparation:
    """What an objective does to a step's batch before its loss (`step_batches`), in the objective's own words:
    `phase`, its name in the step profile; `doing`, what a rank in it does (the hang watchdog's line); `hint`,
    the profile's advice where it takes the largest share of the step."""
    phase: str
    doing: str
    hint: str


# Online RL (online.GroupRL): what its step_batches does, for the step profile and the watchdog.
ONLINE_RL = Preparation(
    "generate", "sampling and scoring completions (online RL)",
    "online RL's completions are sampled token by token (rl.num_generations per prompt, up to rl.max_new_tokens), "
    "scored, and the old and reference log-probabilities taken (rl.num_iterations > 1, rl.beta > 0): fewer or "
    "shorter completions shorten it, rl.num_iterations > 1 trains more steps on each generated batch, and a slow "
    "reward function shows here too")
# KTO (kto.Unpaired, loss_type kto): its KL estimate over the global batch, taken before the step's first loss.
KL_ESTIMATE = Preparation(
    "kl_estimate", "the KL estimate over the global batch's mismatched pairs (KTO)",
    "KTO's KL estimate: every mismatched pair of the global batch (each prompt with another row's completion) "
    "goes through the model, and through the reference where that is the disabled LoRA adapter, without "
    "gradient, before the step's first loss: about one more forward per row; preference.loss_type="
    "apo_zero_unpaired takes no KL estimate")


class Objective(ABC):
    """The contract between the loop and what a batch is trained to do. For the micro-batches of
    one optimizer step the loop calls, in this order:

    1. `step_batches(model, micro_batches, step)`: the micro-batches the loss is taken on. The
       loader's, as they are, for an objective trained on a dataset; an objective that makes its own
       batch (sampling completions for the loader's prompts, scoring them) returns what it made.
       `iterations`: optimizer steps taken on each global batch (the loader repeats it that often);
       `resumable_after(step)`: whether a checkpoint after `step` holds all a resume needs;
       `max_steps`: the run's optimizer steps, set once the loaders know them.
    2. `host_counts(micro_batches)`: [units, tokens, squared document lengths], counted on the host
       before the batches move (no device synchronisation). `units` is what the loss is averaged
       over across the whole global batch (every micro-batch, every rank).
    3. `loss_sum(model, batch)` per micro-batch: the loss summed over the batch's units, a 0-dim
       tensor that carries the gradient. The loop divides by the global count of units, so every
       unit weighs the same whatever the accumulation, the number of ranks or the padding.
    4. `step_metrics(device)`: this rank's sums of the metrics logged beside the loss since the
       last call, summed over ranks in the loss's reduction; `finish_metrics(sums, units)` makes the
       logged values of those global sums (by default each divided by the global units).

    Evaluation calls `loss_sum` and `units` per eval batch, then `step_metrics` and `finish_metrics`,
    and reports the metrics named in `eval_metrics` (and `eval_loss` where `has_eval_loss`), and
    says the answers of `eval_samples()`; `begin_eval(model, batches)` comes first. `describe()`
    gives the start-of-run lines; `unsplittable()` says why the loss cannot be taken on rows split
    across ranks (sequence parallelism), if so; `preparation()` names what `step_batches` does (None:
    nothing, the loader's batches as they are), for the step profile and the watchdog."""

    unit: ClassVar[str]  # what the loss is a mean over, in words ("target tokens", "pairs")
    eval_metrics: ClassVar[tuple[str, ...]] = ()  # step metrics that evaluation reports too (eval_<name>)
    has_eval_loss: ClassVar[bool] = True
    iterations: int = 1
    max_steps: int = 0
    lookahead: int = 0  # later steps' micro-batches step_batches is given (online RL's rl.max_staleness)

    def step_batches(self, model, micro_batches: list[dict[str, torch.Tensor]],
                     step: int, later: list = ()) -> list[dict[str, torch.Tensor]]:
        return micro_batches

    def resumable_after(self, step: int) -> bool:
        return True

    def preparation(self) -> Preparation | None:
        """What `step_batches` does before the loss, in this objective's words; None where it returns the loader's
        batches (their time is the data's). An objective that makes or measures its batch says what it does; one
        that does not gets a name that assumes nothing of it."""
        if type(self).step_batches is Objective.step_batches:
            return None
        name = type(self).__name__
        return Preparation("prepare", f"{name}'s work on the step's batch before its loss",
                           f"what {name}.step_batches does to each step's batch before the loss")

    def finish_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        return {name: value / units for name, value in sums.items()}

    def eval_samples(self) -> list[dict]:
        return []

    def after_prepare(self) -> None:
        """Once the trained model is prepared by the backend: what the objective prepares after it
        (distillation's teacher, held as the backend holds a frozen model)."""

    def close(self) -> None:
        """At the run's end, however it ends: what the objective started stops (online RL's vLLM server)."""

    def save_state(self, folder: Path) -> None:
        """Into a checkpoint being written, on every rank: what the objective holds that the weights do not
        (online RL's batches sampled ahead, rl.max_staleness)."""

    def load_state(self, folder: Path) -> None:
        """From the checkpoint a run resumes from, on every rank: what `save_state` wrote."""

    def begin_eval(self, model, batches) -> None:
        """Before evaluation's batches: what the objective takes over the whole eval set first
        (KTO's KL estimate); `batches` iterates this rank's eval batches on the host."""

    def host_counts(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
        """Units, processed tokens (packed and padding-free rows carry no mask, so their little
        padding counts too) and the sum of squared document lengths (attention's FLOPs) of one
        step's host batches."""
        units = sum(self.units(b) for b in micro_batches)
        tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                     for b in micro_batches)
        squared = sum(int(measure.document_lengths(b).pow(2).sum()) for b in micro_batches)
        return [units, tokens, squared]

    @abstractmethod
    def units(self, batch: dict[str, torch.Tensor]) -> int: ...

    @abstractmethod
    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    @abstractmethod
    def step_metrics(self, device) -> dict[str, torch.Tensor]: ...

    def describe(self) -> list[str]:
        return []

    def unsplittable(self) -> str | None:
        return None

class Supervised(Objective):
    """Next-token cross-entropy on the target tokens (labels != IGNORE): the responses of chat data,
    the whole text of plain text, as the data settings chose (train.loss picks chunked or full).
    `router_aux_coef` (mixture-of-experts models): the router's load-balancing loss of each
    micro-batch, times the coefficient, is added in training, weighted by the micro-batch's target
    tokens so that it too is a mean over the global batch; logged as `aux_loss`. `dft`
    (train.loss_type=dft): each token's cross-entropy times its detached probability (Dynamic
    Fine-Tuning, TRL's SFT loss_type dft), in training and evaluation alike, as TRL's."""

    unit = "target tokens"

    def __init__(self, router_aux_coef: float = 0.0, dft: bool = False):
        self.router_aux_coef, self.dft = router_aux_coef, dft
        self.sums: dict[str, torch.Tensor] = {}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not (self.router_aux_coef and model.training):  # the eval loss is the language-model loss
            return token_loss_sum(model, batch, dft=self.dft)
        loss, aux = token_loss_sum(model, batch, router_aux=True, dft=self.dft)
        weighted = aux * self.units(batch)
        self.sums["aux_loss"] = self.sums.get("aux_loss", 0) + weighted.detach().double()
        return loss + self.router_aux_coef * weighted

    def step_metrics(self, device) -> dict[str, torch.Tensor]:
        """This rank's sums, over the micro-batches since the last call, of the metrics the loop
        logs beside the loss (each divided by the step's global units once reduced); reset."""
        sums, self.sums = self.sums, {}
        names = ["aux_loss"] if self.router_aux_coef else []
        return {name: torch.as_tensor(sums.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in names}


    def describe(self) -> list[str]:
        return ([f"router: load-balancing loss x {self.router_aux_coef:g} added to the training loss (aux_loss)"]
                if self.router_aux_coef else []) \
            + (["loss: dft (Dynamic Fine-Tuning): each target token's cross-entropy times its probability, detached; "
                "eval_loss is the same loss"] if self.dft else [])

    def unsplittable(self) -> str | None:
        return ("the router's load-balancing loss of a mixture-of-experts model is not split across a sequence "
                "group (set model.router_aux_loss_coef=0)") if self.router_aux_coef else None


def preference_losses(method: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_n: torch.Tensor,
                      rejected_n: torch.Tensor, ref_chosen: torch.Tensor | None = None,
                      ref_rejected: torch.Tensor | None = None, *, beta: float, loss_type: str | list[str] = "sigmoid",
                      label_smoothing: float = 0.0, gamma: float = 0.5, valid: torch.Tensor | None = None,
                      **dpo_options):
    """Per pair: (loss, reward of the chosen, reward of the rejected), from each completion's summed
    target log-probabilities (`loss.token_logps`) and target counts, as TRL 1.x defines them:
    - "dpo": TRL 1.16's DPO loss types (`dpo_losses`: `loss_type` a name or a list; label_smoothing,
      `valid`, the pairs aot sorts among, and `dpo_options`, the keys of its own loss types, as there:
      `dpo_losses.options` gathers them from the recipe);
      rewards β·(policy - reference).
    - "simpo" (TRL's CPO with loss_type simpo, no NLL term): average log-probabilities c, r; -log
      σ(β·(c - r - γ/β)), smoothed by label_smoothing; rewards β·c, β·r.
    - "orpo": average log-probabilities c, r; the chosen completion's NLL -c minus β·log σ(log
      odds(c) - log odds(r)), with log odds(p) = p - log(1 - e^p); rewards β·c, β·r. (TRL averages
      the NLL over the batch's chosen tokens; here each pair's is averaged over its own tokens, so
      that every pair weighs the same whatever the batch.)"""
    import torch.nn.functional as F

    if method == "dpo":
        losses = dpo_losses(chosen, rejected, chosen_n, rejected_n, ref_chosen, ref_rejected, beta=beta,
                            loss_type=loss_type, label_smoothing=label_smoothing, valid=valid, **dpo_options)
        return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()
    c, r = chosen / chosen_n, rejected / rejected_n
    if method == "simpo":
        logits = c - r - gamma / beta
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif method == "orpo":
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        losses = -c - beta * F.logsigmoid(log_odds)
    else:
        raise ValueError(f"unknown preference method {method!r}")
    return losses, beta * c.detach(), beta * r.detach()


class Preference(Objective):
    """A preference loss (`preference_losses`) over pairs: each micro-batch holds its chosen
    sequences first and the rejected ones after them (`Collator(pairs=True)`; rows, or the
    documents of a padding-free row), both in
    one forward through `loss.token_logps`. A pair whose chosen or rejected completion has no
    target (eval padding) counts for nothing. The reference log-probabilities (DPO) come with the
    batch (`reference_logps`, precomputed before training: `reference.py`) or from the same
    forward with the LoRA adapter disabled (`adapter`: the peft model, as built). Logged per pair:
    rewards_chosen, rewards_rejected, reward_margin, reward_accuracy (ties count as wrong, as TRL)."""

    unit = "pairs"
    eval_metrics = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, cfg, adapter=None, unused_router_coef: float = 0.0):
        self.cfg, self.adapter = cfg, adapter
        self.needs_reference = cfg.method == "dpo"
        self.unused_router_coef = unused_router_coef  # the router loss the model's config asks for, not added
        self.sums: dict[str, torch.Tensor] = {}

    def describe(self) -> list[str]:
        """What the preference objective is and where DPO's reference comes from."""
        p = self.cfg
        knobs = [f"beta {p.beta:g}"] + (dpo_losses_described(p)[:1] if p.method == "dpo" else []) \
            + ([f"gamma {p.gamma:g}"] if p.method == "simpo" else []) \
            + ([f"label_smoothing {p.label_smoothing:g}"] if p.label_smoothing else []) \
            + (dpo_losses_described(p)[1:] if p.method == "dpo" else [])
        where = {"adapter": "reference: the model with its LoRA adapter disabled (one more forward per micro-batch, "
                            "without gradient; no second model)",
                 "precomputed": "reference: log-probabilities computed once with the starting weights, before step 1, "
                                "and kept beside the prepared data (no second model)"}
        return [f"preference: {p.method}, " + ", ".join(knobs)
                + (f"; {where[p.reference]}" if p.method == "dpo" else "; no reference model")
                + "; the loss is a mean over pairs"] \
            + ([f"router: no load-balancing loss: the model's config asks for one (output_router_logits, "
                f"router_aux_loss_coef {self.unused_router_coef:g}) but the {p.method} loss has no router term yet"]
               if self.unused_router_coef else [])

    def unsplittable(self) -> str | None:
        return "a preference pair's log-probabilities are taken on whole sequences, not on rows split across ranks"

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(self.valid(batch).sum())

    @staticmethod
    def valid(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per pair: whether both its sequences have targets (eval padding has none)."""
        has_targets = sequences_with_targets(batch)
        n = len(has_targets)
        return has_targets[:n // 2] & has_targets[n // 2:]

    def reference_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if self.adapter is None:
            return no_reference("dpo", batch, len(sequences_with_targets(batch)))
        with torch.no_grad(), self.adapter.disable_adapter():
            return token_logps(model, batch)[0]

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        reference = self.reference_logps(model, batch) if self.needs_reference else None
        logps, counts = token_logps(model, batch)
        n = len(logps) // 2
        valid = self.valid(batch)
        counts = counts.clamp(min=1).to(logps.dtype)
        ref = (reference[:n].to(logps.dtype), reference[n:].to(logps.dtype)) if reference is not None else (None, None)
        p = self.cfg
        losses, chosen, rejected = preference_losses(p.method, logps[:n], logps[n:], counts[:n], counts[n:], *ref,
                                                     beta=p.beta, loss_type=p.loss_type,
                                                     label_smoothing=p.label_smoothing, gamma=p.gamma or 0.0,
                                                     valid=valid, **(dpo_options(p) if p.method == "dpo" else {}))
        zero = torch.zeros((), device=logps.device, dtype=torch.float64)
        kept = valid.to(torch.float64)
        for name, value in zip(self.eval_metrics, (chosen, rejected, chosen - rejected, (chosen > rejected))):
            self.sums[name] = self.sums.get(name, zero) + (value.double() * kept).sum()
        return torch.where(valid, losses, torch.zeros_like(losses)).sum()

    def step_metrics(self, device) -> dict[str, torch.Tensor]:
        sums, self.sums = self.sums, {}
        return {name: torch.as_tensor(sums.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in self.eval_metrics}


def no_reference(method: str, batch: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """The reference log-probabilities of a batch that brought none where no adapter computes them
    (DPO's and KTO's, precomputed before training): `n` zeros for a batch of eval padding only (no
    example to bring them, and no loss reads them); refused for a batch with targets, whose loss
    against a reference of 0 would be another objective."""
    if sequences_with_targets(batch).any():
        raise ToolkitError(f"preference: {method.upper()} has no reference log-probabilities for this batch")
    return torch.zeros(n, device=batch["labels"].device)


def sequences_with_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per sequence of the batch (rows; documents of a padding-free row): whether it has a target."""
    sequences = sequence_index(batch)
    targets = batch["labels"][:, 1:] != IGNORE
    n = int(sequences.max()) + 1
    return torch.zeros(n, dtype=torch.long, device=targets.device).index_add(
        0, sequences[targets], torch.ones_like(sequences[targets])) > 0


def for_recipe(recipe, model=None, **_) -> Objective:
    """The recipe's objective trained on a dataset, for `model` as built (before prepare; after LoRA
    for a preference objective, whose DPO reference may be the model with its adapter disabled):
    supervised, with the router's load-balancing loss as model.router_aux_loss_coef says, or
    preference (config/methods.py names the other objectives' builders: KTO's, reward modelling's, online
    RL's)."""
    if recipe.preference.method is not None:
        adapter = model if recipe.preference.reference == "adapter" else None
        return Preference(recipe.preference, adapter,
                          config_router_coef(model) if model is not None and has_router(model) else 0.0)
    coef, dft = recipe.model.router_aux_loss_coef, recipe.train.loss_type == "dft"
    if model is None:
        return Supervised(dft=dft)
    if not has_router(model):
        if coef is not None:
            raise ToolkitError(f"model.router_aux_loss_coef: {type(model).__name__} has no router "
                               "(not a mixture-of-experts model); remove the key")
        return Supervised(dft=dft)
    return Supervised(float(config_router_coef(model) if coef is None else coef), dft=dft)


def config_router_coef(model) -> float:
    """The weight of the router's load-balancing loss the model's own config asks for: its
    router_aux_loss_coef when output_router_logits is true, else 0."""
    return float(model.config.router_aux_loss_coef or 0.0) if model.config.output_router_logits else 0.0
