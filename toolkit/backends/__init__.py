"""The backends: everything that differs between one process, DDP, FSDP and DeepSpeed.

The launch config (`accelerate launch --config_file X.yaml`) picks the backend; `for_launch()`
chooses its class once, from the environment the launcher set, and the run holds that one object.
Every backend-specific operation is a method of it: building the Accelerator (with the CPU-host
quirks of shared/CPU-DISTRIBUTED.md), checking what `prepare` made, the optimizer and scheduler a
DeepSpeed JSON may bring, the optimizer step and loss scale, how many times a collective module is
called, saving (gathering shards), reading a checkpoint back, and the portable state. The loop,
the loss and the checkpoint code call these methods and never name a backend.

- `base.py`: `Backend`, one process; the defaults every backend starts from.
- `ddp.py`, `fsdp.py`, `deepspeed.py`: what each changes.
"""

from __future__ import annotations

import os

from .base import Backend, end_process_group, launched_world_size
from .ddp import DDP
from .deepspeed import DeepSpeed
from .fsdp import FSDP
from .launch_config import launch_kind

BY_KIND = {"single": Backend, "ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}

__all__ = ["Backend", "DDP", "FSDP", "DeepSpeed", "for_launch", "end_process_group", "launched_world_size"]


def for_launch(env=None) -> Backend:
    """The backend `accelerate launch` asked for (one process when run without it)."""
    kind = launch_kind(os.environ if env is None else env)
    return BY_KIND[kind](kind)
