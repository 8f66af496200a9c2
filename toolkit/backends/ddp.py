"""DDP: every rank holds the whole model and optimizer; gradients are averaged in backward. The
one-process defaults hold for everything but the check of what `prepare` made."""

from __future__ import annotations

import torch

from ..errors import ToolkitError
from .base import Backend


class DDP(Backend):
    def layout(self) -> str:
        return "DDP"

    def check_prepared(self, model) -> None:
        if self.accelerator.num_processes > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ToolkitError("launch: several processes were started but the model is not wrapped for DDP")
