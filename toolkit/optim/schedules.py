"""The learning-rate schedules a recipe names (`train.lr_scheduler_type`): transformers' own, built by
`transformers.get_scheduler` itself (so the learning rate of every step is the one a Trainer or TRL
run with the same settings uses), and the toolkit's default `warmup_cosine`.

`warmup_cosine` (the default since the first release): linear warmup in which the first step already
trains at learning_rate / warmup_steps (transformers' warmups start at 0), then cosine decay to
learning_rate x min_lr_ratio at the last step. transformers' `cosine_with_min_lr` with the same
min_lr_rate differs from it only in the warmup's first steps.
"""

from __future__ import annotations

import inspect
import math

DEFAULT = "warmup_cosine"
TRANSFORMERS = ("linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr", "constant", "constant_with_warmup",
                "polynomial", "inverse_sqrt", "warmup_stable_decay")
NAMES = (DEFAULT, *TRANSFORMERS)
# what get_scheduler fills itself: never a key of lr_scheduler_kwargs
_FILLED = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}


def kwargs_accepted(name: str) -> list[str]:
    """The keyword arguments schedule `name` takes in lr_scheduler_kwargs."""
    if name == DEFAULT:
        return []
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    return [p for p in inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters
            if p not in _FILLED]


def warmup_steps(t, total_steps: int) -> int:
    """The run's warmup: train.warmup_steps, else ceil(train.warmup_ratio x total_steps) as transformers
    counts a ratio, at most the run's length."""
    wanted = t.warmup_steps if t.warmup_steps else math.ceil(total_steps * t.warmup_ratio)
    return min(wanted, total_steps)


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """LR multiplier for the i-th optimizer step (i from 0): linear warmup, then cosine decay."""

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        progress = min(1.0, (i - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def describe(t, total_steps: int) -> str:
    """The schedule in one line of the start-of-run summary."""
    warmup = warmup_steps(t, total_steps)
    how = f" (train.warmup_ratio {t.warmup_ratio:g})" if not t.warmup_steps and t.warmup_ratio else ""
    cut = (f" (train.warmup_steps {t.warmup_steps} cut to the run's {total_steps} steps)"
           if t.warmup_steps > total_steps else "")
    steps = f"{warmup} step{'s' if warmup != 1 else ''}{how}{cut}"
    if t.lr_scheduler_type == DEFAULT:
        return (f"schedule linear warmup over {steps}, then cosine decay to {t.min_lr_ratio:g} x learning_rate "
                f"at step {total_steps} (recipe)")
    kwargs = "".join(f", {k} {v}" for k, v in t.lr_scheduler_kwargs.items())
    return f"schedule {t.lr_scheduler_type} (transformers') with {warmup} warmup {steps[len(str(warmup)) + 1:]} of " \
           f"{total_steps}{kwargs} (recipe)"
