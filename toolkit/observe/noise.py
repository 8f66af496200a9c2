"""Library output that says nothing to the user, dropped once at the start of every process (the CLI
installs it before a verb imports torch). Each noise is named by its message and the module or
logger that emits it, never by a whole category or library: a library's other warnings, and every
line of the toolkit's own, still print. Imports nothing but the standard library.

A noise belongs here when it repeats without news (per collective, per step, per checkpoint, per
rank) or tells the user something they can neither act on nor need (a library's own deprecation
of another library's call). `tests/test_log_noise.py` counts a 2-process ZeRO-3 run's lines."""

from __future__ import annotations

import logging
import re
import warnings

# (category, the message's start (a regex), the module that emits it (a regex)): Python warnings.
WARNINGS = [
    # torch 2.13 deprecated the collectives DeepSpeed 0.19.8 calls: ZeRO-3 gathers parameters and
    # reduce-scatters gradients through them on every rank, every micro-batch, and the warning
    # re-prints each time: 1,982 of a 2,071-line 8-step run's lines. DeepSpeed, not the user, has to
    # move to the new names; training is unaffected.
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\.distributed\.c10d_logger"),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated", r"torch\.distributed\.c10d_logger"),
    # transformers 5 renamed a property that peft 0.21 still reads when it wraps a model for LoRA
    # (peft_model.py): once per rank and run, peft's to change.
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated", r"transformers\.modeling_utils"),
]

# (logger, level, the message's start (a regex)): records of the `logging` module.
LOG_RECORDS = [
    # DeepSpeed's accelerator detection on a host without CUDA, once per process that imports it
    # (every rank, and single-process runs too, since accelerate imports DeepSpeed); the run's
    # `run: backend ..., N processes on cpu` line says where it trains.
    ("DeepSpeed", logging.WARNING, r"Setting accelerator to CPU\."),
    # bitsandbytes 0.50 on a CPU with AVX512-BF16, once per process that imports peft: a kernel of the
    # `kernels` hub it cannot fetch offline and that the toolkit never uses (model/load.py one_4bit_path).
    ("bitsandbytes.backends.cpu.ops", logging.WARNING, r"Failed to load CPU gemm_4bit_forward from kernels-community"),
]


class DropRecords(logging.Filter):
    """Drops a logger's records of one level whose message starts as `message` does."""

    def __init__(self, level: int, message: str):
        super().__init__()
        self.level, self.message = level, re.compile(message)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == self.level and self.message.match(record.getMessage()))


FILTERS = [(name, DropRecords(level, message)) for name, level, message in LOG_RECORDS]


def install() -> None:
    """Drop the noise of WARNINGS and LOG_RECORDS in this process (calling it again changes nothing).
    A logger's filter is set on the logger itself, which works before the library creates it:
    `logging.getLogger(name)` returns the object the library will configure."""
    for category, message, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, drop in FILTERS:
        logging.getLogger(name).addFilter(drop)
