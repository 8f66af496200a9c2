"""Reward modelling (preference.method=reward), TRL 1.16's RewardTrainer as an objective of the loop:
the model is a sequence-classification model with one output (`model.load.build_model(scorer=True)`),
whose score of a sequence is read at its last token, and each preference pair (data.format=preference)
is trained with the Bradley-Terry loss

    -log σ(s_chosen - s_rejected - margin) + center_rewards_coefficient x (s_chosen + s_rejected)²

(`margin`: the row's column of that name, 0 without one). The loss is a mean over the global batch's
pairs; TRL's mean over a micro-batch is the same number where the global batch is one micro-batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .objectives import Objective, Preference


def pair_score_losses(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor | None = None,
                      center: float | None = None) -> torch.Tensor:
    """Each pair's loss from its two scores, as TRL's RewardTrainer.compute_loss."""
    difference = chosen - rejected - (margins if margins is not None else 0.0)
    losses = -F.logsigmoid(difference)
    if center is not None:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


def for_recipe(recipe, model=None, **_) -> PairScores:
    """The reward model's objective: the pairs' Bradley-Terry loss as preference.* sets it."""
    return PairScores(recipe.preference)


class PairScores(Objective):
    """A reward model trained on pairs (see the module). A micro-batch holds the chosen sequences first
    and the rejected ones after them (`Collator(pairs=True)`), scored in one forward. Logged per pair:
    rewards_chosen and rewards_rejected (the mean scores), reward_margin and reward_accuracy (the
    share of pairs whose chosen score is higher; ties count as wrong, as TRL's accuracy)."""

    unit = "pairs"
    eval_metrics = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, cfg):
        self.cfg = cfg
        self.sums: dict[str, torch.Tensor] = {}

    def describe(self) -> list[str]:
        c = self.cfg.center_rewards_coefficient
        return ["preference: reward model, the Bradley-Terry loss on each pair's two scores (minus the row's margin "
                "where the data has one)" + (f", plus {c:g} x their squared sum" if c else "")
                + "; the loss is a mean over pairs"]

    def unsplittable(self) -> str | None:
        return "a reward model scores whole sequences, not rows split across ranks"

    def units(self, batch: dict) -> int:
        return int(Preference.valid(batch).sum())

    def loss_sum(self, model, batch: dict) -> torch.Tensor:
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits[:, 0].float()
        n = len(scores) // 2
        chosen, rejected = scores[:n], scores[n:]
        losses = pair_score_losses(chosen, rejected, batch.get("margins"), self.cfg.center_rewards_coefficient)
        valid = Preference.valid(batch)
        kept = valid.double()
        c, r = chosen.detach().double(), rejected.detach().double()
        for name, value in zip(self.eval_metrics, (c, r, c - r, (c > r).double())):
            self.sums[name] = self.sums.get(name, 0.0) + (value * kept).sum()
        return torch.where(valid, losses, torch.zeros_like(losses)).sum()

    def step_metrics(self, device) -> dict[str, torch.Tensor]:
        sums, self.sums = self.sums, {}
        return {name: torch.as_tensor(sums.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in self.eval_metrics}
