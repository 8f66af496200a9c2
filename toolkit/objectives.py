"""What a batch is trained to do: the loss of a batch and what it is normalised by. The loop asks
its objective for both and knows nothing else about the loss, so another objective (preference
pairs, say) is a class here, not branches in the loop.

An objective gives, for the micro-batches of one optimizer step:
- `host_counts(micro_batches)`: [units, tokens, squared document lengths] counted on the host
  before the batches move (no device synchronisation). `units` is what the loss is averaged over
  across the whole global batch (every micro-batch, every rank): target tokens for `Supervised`.
- `loss_sum(model, batch)`: the loss summed over the batch's units, a 0-dim tensor that carries
  the gradient. The loop divides by the global count of units, so every unit weighs the same
  whatever the accumulation, the number of ranks or the padding.
"""

from __future__ import annotations

import torch

from . import observe
from .data import IGNORE
from .loss import token_loss_sum


class Supervised:
    """Next-token cross-entropy on the target tokens (labels != IGNORE): the responses of chat data,
    the whole text of plain text, as the data settings chose (train.loss picks chunked or full)."""

    unit = "target tokens"

    def host_counts(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
        """Target tokens, processed tokens (packed rows carry no mask, so their little padding counts
        too) and the sum of squared document lengths (attention's FLOPs) of one step's host batches."""
        targets = sum(self.units(b) for b in micro_batches)
        tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                     for b in micro_batches)
        squared = sum(int(observe.document_lengths(b).pow(2).sum()) for b in micro_batches)
        return [targets, tokens, squared]

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE).sum())

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_loss_sum(model, batch)


def for_recipe(recipe) -> Supervised:
    """The recipe's objective (supervised fine-tuning is the only one so far)."""
    return Supervised()
