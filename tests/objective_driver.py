"""`python tests/objective_driver.py [--remade] RECIPE.yaml [overrides]`: the toolkit's training run
with an objective of the test's own in place of the recipe's, for tests only. Each plugs in where
every objective does (`objectives.for_recipe`), with no change to the loop:

- `Doubled` (the default): the loss of a batch is twice the supervised loss, counted over the same units.
- `Remade` (`--remade`): implements the `Objective` contract itself and makes its own batch each
  step (`step_batches`), as online RL does with its sampled completions: here every micro-batch
  the loader gave, twice over. The loop must count and train on what it made.
"""

import sys

import torch

from toolkit import cli
from toolkit.training import objectives
from toolkit.training.loss import token_loss_sum


class Doubled(objectives.Supervised):
    def loss_sum(self, model, batch):
        return 2 * super().loss_sum(model, batch)


class Remade(objectives.Objective):
    unit = "target tokens"

    def step_batches(self, model, micro_batches, step, later=()):
        return [{k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                for b in micro_batches]

    def units(self, batch):
        return int((batch["labels"][:, 1:] != -100).sum())

    def loss_sum(self, model, batch):
        return token_loss_sum(model, batch)

    def step_metrics(self, device):
        return {}


if __name__ == "__main__":
    args = sys.argv[1:]
    made = Remade if "--remade" in args else Doubled
    objectives.for_recipe = lambda recipe, model=None, **_: made()
    sys.exit(cli.main(["train", *[a for a in args if a != "--remade"]]))
