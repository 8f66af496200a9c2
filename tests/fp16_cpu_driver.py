"""`python tests/fp16_cpu_driver.py RECIPE.yaml [overrides]` (or under `accelerate launch`):
the toolkit's training run with train.precision=fp16 on a CPU host, for tests only.

On CUDA, accelerate gives fp16 a torch GradScaler; on CPU it gives none (and the toolkit refuses
fp16 there). This driver builds the accelerator as the toolkit does, then hands it what CUDA
would have: accelerate's fp16 mode (CPU fp16 autocast, unscale before clipping) and a real
`torch.amp.GradScaler("cpu")` starting at train.initial_loss_scale. Everything after that is the
toolkit's own loop, so the overflow bookkeeping (skipped steps, loss_scale, schedule held still,
unscaled grad_norm, the non-finite stop) runs as it would on a GPU.
"""

import sys

import torch

from toolkit import cli
from toolkit.backends import Backend

build = Backend.make_accelerator


def make_fp16_accelerator(self, recipe, source="recipe"):
    assert recipe.train.precision == "fp16" and not torch.cuda.is_available()
    recipe.train.precision = "fp32"  # past the CPU refusal
    try:
        accelerator = build(self, recipe, source)
    finally:
        recipe.train.precision = "fp16"
    accelerator.state._mixed_precision = "fp16"
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=recipe.train.initial_loss_scale)
    return accelerator


Backend.make_accelerator = make_fp16_accelerator  # every backend's, all build it here
if __name__ == "__main__":
    sys.exit(cli.main(["train", *sys.argv[1:]]))
