"""Validation after loading: contradictions and out-of-range values, each a ConfigError naming its key,
in the order the sections come: the run's own keys, the model (`validate_model.py`), the data, the
training and checkpoints, then the objectives (`validate_objectives.py`)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from ..errors import ConfigError, command
from ..optim import optimizers, schedules
from .data import DataSource
from .methods import method_of
from .recipe import CHANGEABLE_INPUTS, Recipe
from .validate_model import validate_model
from .validate_objectives import validate_preference, validate_rl


def validate(r: Recipe, source: str) -> None:
    """Contradictions and out-of-range values, each naming its key."""

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(source, key, message)

    need(bool(r.output_dir), "output_dir", "required: the folder this run writes to")
    r.output_dir = str(Path(r.output_dir).expanduser())  # `~/runs/x` is the home folder's, as in a shell
    if r.model.path is not None and r.model.path.startswith("~"):
        r.model.path = str(Path(r.model.path).expanduser())
    if r.resume not in (None, "auto") and r.resume.startswith("~"):
        r.resume = str(Path(r.resume).expanduser())
    need(0 <= r.seed < 2**32, "seed", f"must be in [0, 2**32), got {r.seed}")
    need(all(x in CHANGEABLE_INPUTS for x in r.resume_accept_changed), "resume_accept_changed",
         f"each must be one of {', '.join(CHANGEABLE_INPUTS)}, got {r.resume_accept_changed!r}")
    validate_model(r, need)
    validate_data(r, need)
    validate_train(r, need)
    need(not (r.resume and r.overwrite), "resume", "resume and overwrite=true contradict each other")
    need(r.preference.method is None or r.rl.method is None, "preference.method",
         f"one objective per run: preference.method={r.preference.method} and rl.method={r.rl.method} contradict "
         "each other; remove one")
    validate_preference(r, need)
    validate_rl(r, need)



def validate_data(r: Recipe, need) -> None:
    """The data section: files given, entries' weights and row limits, lengths and the eval split."""
    need(bool(r.data.train_files), "data.train_files", "required: at least one training file")
    for name in ("train_files", "eval_files"):
        for i, e in enumerate(getattr(r.data, name)):
            key = f"data.{name}[{i}]"
            need(e != "" and getattr(e, "path", "x") != "", key + (".path" if not isinstance(e, str) else ""),
                 "required: a file, folder, glob or Hub dataset id")
            if isinstance(e, DataSource):
                need(e.weight is None or e.weight > 0, key + ".weight", f"must be positive, got {e.weight}")
                need(e.weight is None or name == "train_files", key + ".weight", "weights mix training data only")
                need(e.max_rows is None or e.max_rows > 0, key + ".max_rows", f"must be positive, got {e.max_rows}")
    need(r.data.num_proc is None or r.data.num_proc > 0, "data.num_proc", f"must be positive, got {r.data.num_proc}")
    need(r.data.max_seq_len >= 2, "data.max_seq_len", f"must be at least 2, got {r.data.max_seq_len}")
    if r.data.overlong is None:  # unset: a reward model drops longer pairs, as TRL's RewardTrainer
        r.data.overlong = method_of(r).overlong
    need(0.0 <= r.data.eval_fraction < 1.0, "data.eval_fraction", f"must be in [0, 1), got {r.data.eval_fraction}")
    need(not (r.data.eval_files and r.data.eval_fraction), "data.eval_fraction",
         "give either data.eval_files or data.eval_fraction, not both")


def validate_train(r: Recipe, need) -> None:
    """The train and checkpoint sections: batch, optimizer, schedule, logging, trackers, checkpoints."""
    t = r.train
    need(t.micro_batch_size > 0, "train.micro_batch_size", f"must be positive, got {t.micro_batch_size}")
    need(t.gradient_accumulation_steps > 0, "train.gradient_accumulation_steps",
         f"must be positive, got {t.gradient_accumulation_steps}")
    need(t.max_steps is None or t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    need(t.epochs > 0, "train.epochs", f"must be positive, got {t.epochs}")
    need(t.learning_rate > 0, "train.learning_rate", f"must be positive, got {t.learning_rate}")
    need(t.embedding_learning_rate is None or t.embedding_learning_rate > 0, "train.embedding_learning_rate",
         f"must be positive, got {t.embedding_learning_rate}")
    need(t.weight_decay >= 0, "train.weight_decay", f"must be non-negative, got {t.weight_decay}")
    need(0 <= t.adam_beta1 < 1, "train.adam_beta1", f"must be in [0, 1), got {t.adam_beta1}")
    need(0 <= t.adam_beta2 < 1, "train.adam_beta2", f"must be in [0, 1), got {t.adam_beta2}")
    need(t.adam_epsilon > 0, "train.adam_epsilon", f"must be positive, got {t.adam_epsilon}")
    need(t.warmup_steps >= 0, "train.warmup_steps", f"must be non-negative, got {t.warmup_steps}")
    need(0.0 <= t.warmup_ratio < 1.0, "train.warmup_ratio", f"must be in [0, 1), got {t.warmup_ratio}")
    need(not (t.warmup_steps and t.warmup_ratio), "train.warmup_ratio",
         f"give either train.warmup_steps ({t.warmup_steps}) or train.warmup_ratio ({t.warmup_ratio:g}), not both")
    need(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    need(not t.min_lr_ratio or t.lr_scheduler_type in ("warmup_cosine", "cosine_with_min_lr"), "train.min_lr_ratio",
         f"is read by the warmup_cosine and cosine_with_min_lr schedules only, and train.lr_scheduler_type is "
         f"{t.lr_scheduler_type}; remove it (or give the schedule's own floor in train.lr_scheduler_kwargs)")
    accepted = schedules.kwargs_accepted(t.lr_scheduler_type)
    for key in t.lr_scheduler_kwargs:
        need(key in accepted, f"train.lr_scheduler_kwargs.{key}",
             f"not an argument of the {t.lr_scheduler_type} schedule"
             + (f" (it takes {', '.join(accepted)})" if accepted else " (it takes none)"))
    opt = optimizers.OPTIMIZERS[t.optim]
    need(opt.package is None or importlib.util.find_spec(opt.package) is not None, "train.optim",
         f"{t.optim} needs {opt.package}, which is not installed: " + command(f"python -m pip install {opt.package}"))
    accepted = optimizers.args_accepted(t.optim)
    for key in t.optim_args:
        need(key in accepted, f"train.optim_args.{key}", f"not an argument of {t.optim} ({opt.what})"
             + (f"; it takes {', '.join(accepted)}" if accepted else "; it takes none"))
    need(t.initial_loss_scale >= 1 and math.log2(t.initial_loss_scale).is_integer(), "train.initial_loss_scale",
         f"must be a power of two >= 1 (e.g. 65536), got {t.initial_loss_scale}")
    need(t.loss_chunk_tokens > 0, "train.loss_chunk_tokens", f"must be positive, got {t.loss_chunk_tokens}")
    need(t.max_grad_norm >= 0, "train.max_grad_norm", f"must be non-negative, got {t.max_grad_norm}")
    need(t.eval_every_steps >= 0, "train.eval_every_steps", f"must be non-negative, got {t.eval_every_steps}")
    need(t.eval_batch_size is None or t.eval_batch_size > 0, "train.eval_batch_size",
         f"must be positive, got {t.eval_batch_size}")
    need(t.log_every_steps > 0, "train.log_every_steps", f"must be positive, got {t.log_every_steps}")
    need(all(isinstance(p, str) and p.strip() for p in t.sample_prompts), "train.sample_prompts",
         "must be a list of non-empty strings")
    need(t.sample_max_new_tokens > 0, "train.sample_max_new_tokens",
         f"must be positive, got {t.sample_max_new_tokens}")
    need(t.peak_tflops is None or t.peak_tflops > 0, "train.peak_tflops", f"must be positive, got {t.peak_tflops}")
    need(t.profile_steps is None or (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1]),
         "train.profile_steps", f"must be [first, last] optimizer steps with 1 <= first <= last, got {t.profile_steps}")
    need(t.watchdog_seconds is None or t.watchdog_seconds > 0, "train.watchdog_seconds",
         f"must be positive, got {t.watchdog_seconds}")
    for tracker, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow-skinny"),
                             ("trackio", "trackio")):
        need(tracker not in t.report_to or importlib.util.find_spec(tracker) is not None, "train.report_to",
             f"{tracker} is not installed: " + command(f"python -m pip install {package}"))
    need(t.max_nonfinite_steps > 0, "train.max_nonfinite_steps", f"must be positive, got {t.max_nonfinite_steps}")
    need(r.checkpoint.every_steps >= 0, "checkpoint.every_steps",
         f"must be non-negative, got {r.checkpoint.every_steps}")
    need(r.checkpoint.keep_last > 0, "checkpoint.keep_last", f"must be positive, got {r.checkpoint.keep_last}")
