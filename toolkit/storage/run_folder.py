"""The run folder: when a run may write into `output_dir`, which checkpoint it continues from,
whether that checkpoint fits this launch, and the files that record each launch.

`output_dir/` holds `config.yaml` (the resolved recipe), `manifest.json` (one entry per launch),
`metrics.jsonl`, `checkpoints/step-N/` (see checkpoint.py), `base-model/` (a preset's weights,
for a LoRA run) and `final/`. Every resume decision is made here, before anything is written:

- `resume=auto` continues `output_dir` from its newest complete checkpoint (or starts again when a
  run of the same recipe was killed before its first one); a checkpoint path continues into an
  empty `output_dir`; anything else that would write over earlier results is refused.
- A checkpoint written by the same launch layout loads the backend's own sharded state (bitwise
  resume). One written under another backend or process count loads its portable state, as long
  as the global batch is the same.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

from ..config import Recipe, dump_recipe, load_recipe
from ..errors import ToolkitError
from . import checkpoint, inputs

RUN_FILES = {"config.yaml", "manifest.json", "metrics.jsonl", "completions.jsonl", "checkpoints", "base-model",
             "tensorboard", "profile", "profile.json", "hang", "plot.png", "vllm.log", "rollout-adapter",
             "rollout-weights"}
LOCK = ".toolkit.lock"  # pid, host and start time of the run writing this folder
# What a run folder may hold besides RUN_FILES: its results and what a killed save leaves (checkpoint.tidy).
RUN_RESULTS = {"final", "final.tmp", ".del-final", "base-model.tmp", ".del-base-model", LOCK}
# Recipe fields that may change between a run and its resumption (they do not change what is learned;
# train.loss and its chunk size change only the order of a sum's additions). The global batch is
# compared on its own: micro_batch_size x gradient_accumulation_steps x processes may be split differently.
RESUMABLE_CHANGES = {"output_dir", "resume", "resume_new_global_batch", "resume_accept_changed", "overwrite",
                     "checkpoint", "train.log_every_steps", "train.sample_prompts",
                     "train.sample_max_new_tokens", "train.loss", "train.loss_chunk_tokens",
                     "train.micro_batch_size", "train.gradient_accumulation_steps", "train.eval_batch_size",
                     "train.report_to", "train.project", "train.run_name", "train.peak_tflops", "train.profile_steps",
                     "train.watchdog",
                     "train.watchdog_seconds", "data.padding_free", "model.attn_implementation", "train.compile",
                     "data.num_proc", "data.eval_files", "train.eval_every_steps", "train.max_nonfinite_steps",
                     "rl.log_completions", "rl.num_generations_eval", "rl.num_completions_to_print",
                     "rl.gather_for_sampling", "rl.vllm_url", "rl.vllm_python", "rl.vllm_args", "rl.vllm_timeout"}


def open_run(accelerator, recipe: Recipe, lock: "RunLock") -> Path | None:
    """Take the run folder's lock (main process), tidy what a killed save left, find the checkpoint
    to resume from (None: a fresh start) and check that `output_dir` may be written. Nothing is
    removed here: under overwrite=true the old run is cleared by `record_launch`, once the new run
    has passed every check and is about to train. Every rank."""
    out = Path(recipe.output_dir)
    if accelerator.is_main_process:
        note = lock.acquire()
        if note:
            accelerator.print(f"output_dir: {note}")
        if out.is_dir() and recipe.resume is not None:
            for line in checkpoint.tidy(out):
                accelerator.print(f"checkpoints: {line}")
    accelerator.wait_for_everyone()  # every rank then finds the same checkpoint
    resume_from = checkpoint.find_resume(recipe.resume, out)
    check_output_dir(out, recipe, resume_from)
    return resume_from


def contents(out: Path) -> list[Path]:
    """What `out` holds, leaving out this run's own lock."""
    return [p for p in out.iterdir() if p.name != LOCK] if out.is_dir() else []


def check_output_dir(out: Path, recipe: Recipe, resume_from: Path | None = None) -> None:
    """Refuse to write into earlier results unless resuming them or asked to replace a run folder
    (overwrite=true; never a folder that holds anything a run did not write). A resume continues
    the run that wrote the checkpoint, from its newest checkpoint, or starts a new run (an empty
    output_dir) from another run's checkpoint."""
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"output_dir: {out} exists and is not a folder")
    if resume_from is not None:
        if resume_from.resolve().parent == checkpoint.checkpoint_dir(out).resolve():
            newest = checkpoint.complete_checkpoints(out)[-1]
            if newest.resolve() != resume_from.resolve():
                raise ToolkitError(f"resume: {resume_from} is not the newest checkpoint of {out} ({newest.name} is); "
                                   "continuing from it would replace the later ones. Resume from it into a new, "
                                   "empty output_dir instead")
        elif contents(out):
            raise ToolkitError(f"output_dir: {out} is not empty and resume={recipe.resume} is a checkpoint of "
                               "another run; resume from it into an empty output_dir (a new run that continues "
                               f"from that checkpoint), or use resume=auto to continue {out} itself")
        return
    if contents(out):
        if recipe.resume == "auto":
            if never_checkpointed(out, recipe):
                return  # killed before its first checkpoint: start again from step 0
            raise ToolkitError(f"output_dir: {out} is not empty and has no complete checkpoint to resume from")
        if not recipe.overwrite:
            raise ToolkitError(f"output_dir: {out} is not empty; choose another folder, resume=auto to continue "
                               "it, or overwrite=true")
        foreign = sorted(p.name for p in contents(out) if p.name not in RUN_FILES | RUN_RESULTS)
        if foreign or not (out / "config.yaml").is_file():
            held = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ToolkitError(f"output_dir: {out} is not a toolkit run folder (" +
                               (f"it holds {held}" if foreign else "no config.yaml") +
                               "); overwrite=true only replaces an earlier run. Choose another folder")


def clear_for_overwrite(out: Path) -> list[str]:
    """overwrite=true, main process, once the new run is about to train: remove the earlier run's
    files (check_output_dir made sure that is all the folder holds)."""
    removed = []
    for p in contents(out):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p.name)
    return sorted(removed)


class RunLock:
    """`output_dir/.toolkit.lock`: the pid, host and start of the run writing the folder, created
    atomically, so a second run into the same folder is refused in one line. A lock whose process
    is gone (same host) is stale and taken over; one from another host is reported, not broken.
    `release` removes it, and the folder too when this run created it and left nothing in it."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / LOCK
        self.held = self.created_dir = False

    def acquire(self) -> str | None:
        """Take the lock; returns a note when a stale one was taken over."""
        import os
        import platform

        if self.out.exists() and not self.out.is_dir():
            raise ToolkitError(f"output_dir: {self.out} exists and is not a folder")
        try:
            self.created_dir = not self.out.exists()
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ToolkitError(f"output_dir: cannot create {self.out}: {e.strerror or e}") from None
        me = {"pid": os.getpid(), "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        note = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None or not self._stale(holder):
                    who = f"process {holder['pid']} on {holder['host']} (since {holder['started']})" if holder else \
                        "another run"
                    raise ToolkitError(f"output_dir: {self.out} is in use by {who}; wait for it to finish or choose "
                                       f"another folder (if no run is using it, remove {self.path})") from None
                self.path.unlink(missing_ok=True)  # its process is gone: the folder is free again
                note = f"took over the lock of process {holder['pid']} (since {holder['started']}), which has ended"
                continue
            except OSError as e:
                raise ToolkitError(f"output_dir: cannot write {self.out}: {e.strerror or e}") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return note
        raise ToolkitError(f"output_dir: {self.out}: could not take its lock {self.path}")

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) and {"pid", "host", "started"} <= set(holder) else None
        except (OSError, ValueError):
            return None  # being written this instant, or unreadable: treat as held

    @staticmethod
    def _stale(holder: dict) -> bool:
        import os
        import platform

        if holder["host"] != platform.node():
            return False
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError):
            return False
        return False

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            self.path.unlink(missing_ok=True)
            if self.created_dir and not any(self.out.iterdir()):
                self.out.rmdir()
        except OSError:
            pass


def check_free_space(out: Path, recipe: Recipe, trainable: int, total: int) -> str | None:
    """Refuse a run whose final model (and, with checkpoint.every_steps, one checkpoint) cannot fit
    in the free space of output_dir's file system, before anything is written; a warning (returned)
    when the checkpoints kept (keep_last, plus one being written) may not."""
    from . import disk

    weights = (trainable if recipe.lora.enabled else total) * 4  # fp32 trainable weights (bf16 bases are not saved)
    # + AdamW moments, portable
    states = weights + 8 * trainable + (12 * trainable if recipe.checkpoint.portable else 0)
    need = weights + (states if recipe.checkpoint.every_steps else 0)
    free = disk.free_bytes(out)
    if free < need:
        raise ToolkitError(f"output_dir: {out} has {disk.human(free)} free; this run writes about {disk.human(need)} "
                           f"(the final model {disk.human(weights)}" +
                           (f", a checkpoint {disk.human(states)})" if recipe.checkpoint.every_steps else ")") +
                           "; free some space or choose another folder")
    kept = weights + states * (recipe.checkpoint.keep_last + 1) if recipe.checkpoint.every_steps else need
    if free < kept:
        return (f"output_dir: {disk.human(free)} free, and {recipe.checkpoint.keep_last} checkpoints kept plus one "
                f"being written and the final model need about {disk.human(kept)}")
    return None


def never_checkpointed(out: Path, recipe: Recipe) -> bool:
    """A run of this same recipe that was killed before its first checkpoint was complete (no
    final/, nothing but its own files): starting it again from step 0 loses nothing."""
    if not {p.name for p in contents(out)} <= RUN_FILES or not (out / "config.yaml").is_file():
        return False
    try:
        earlier = load_recipe(out / "config.yaml")
    except ToolkitError:
        return False
    return learning_relevant(earlier) == learning_relevant(recipe)


def learning_relevant(recipe: Recipe) -> dict:
    """The recipe as a flat dict of dotted keys, without the fields a resumed run may change."""
    return flat_recipe(recipe, leave_out=RESUMABLE_CHANGES)


def flat_recipe(recipe: Recipe, leave_out: set[str] = frozenset()) -> dict:
    """The recipe as a flat dict of dotted keys (`train.learning_rate`)."""
    flat = {}

    def walk(node, prefix):
        for k, v in node.items():
            key = prefix + k
            if key in leave_out:
                continue
            if isinstance(v, dict):
                walk(v, key + ".")
            else:
                flat[key] = v

    walk(recipe.to_dict(), "")
    return flat


def check_resumable(saved: checkpoint.TrainerState, now: checkpoint.TrainerState, path: Path,
                    new_global_batch: bool = False, accept: tuple | list = ()) -> bool:
    """Resuming must continue the same run: same data, same recipe, same global batch (unless
    `new_global_batch`: resume_new_global_batch=true). Returns whether the checkpoint was written
    under another layout (another backend, sharding or process count): then its portable state is
    loaded instead of the backend's own."""
    moved = (saved.layout or now.layout) != now.layout or saved.world_size != now.world_size \
        or saved.launch != now.launch
    if saved.global_batch != now.global_batch and not new_global_batch:  # the sampler's batches would shift
        raise ToolkitError(
            f"resume: {path} was trained with a global batch of {saved.global_batch} sequences and this launch makes "
            f"{now.global_batch} (micro_batch_size x gradient_accumulation_steps x {now.world_size} process"
            f"{'es' if now.world_size > 1 else ''}); keep it at {saved.global_batch}, split differently if need be, "
            "or set resume_new_global_batch=true to continue at the samples seen with the new one")
    if moved and not (path / "portable").is_dir():
        raise ToolkitError(
            f"resume: {path} was written by {saved.world_size} process(es) under {saved.layout or saved.launch} "
            f"without its portable state (checkpoint.portable=false, or an older toolkit); this launch is "
            f"{now.world_size} under {now.layout}. Resume with the launch config and process count that wrote it")
    moved_data = bool(saved.data_content) and saved.data_content == now.data_content  # same content elsewhere
    if saved.data_fingerprint != now.data_fingerprint and not moved_data:
        raise ToolkitError(f"resume: the training data changed since {path} was written "
                           f"(fingerprint {saved.data_fingerprint[:12]} -> {now.data_fingerprint[:12]})")
    inputs.check_unchanged(saved.inputs, now.inputs, path, accept)
    defaults = flat_recipe(Recipe())
    for key in sorted(set(saved.recipe or {}) | set(now.recipe or {})):
        before, after = (saved.recipe or {}).get(key), (now.recipe or {}).get(key)
        if key not in (saved.recipe or {}) and key in defaults and after == defaults[key]:
            continue  # a key added since that checkpoint, at its default: what the older toolkit did
        if key in inputs.PATH_KEYS and inputs.recorded_both(saved.inputs, now.inputs, inputs.PATH_KEYS[key]) \
                or key == "data.train_files" and moved_data:
            continue  # where the input is checked by content, its path may change (models kept elsewhere)
        if before != after:
            longer = key in ("train.max_steps", "train.epochs")  # the schedule was laid out over the run's length
            raise ToolkitError(f"resume: {key} was {before!r} when {path} was written, now {after!r}; "
                               "a resumed run must keep its recipe" + (
                                   f" (its learning-rate schedule runs over that length): resume with {key}="
                                   f"{'null' if before is None else before} to finish it, then train further in a "
                                   "new run from its weights (model.path=OUTPUT_DIR/final for full fine-tuning)"
                                   if longer else ""))
    return moved


def resume(backend, path: Path, now: checkpoint.TrainerState, model, optimizer, scheduler, recipe: Recipe,
           rows: int) -> checkpoint.TrainerState:
    """Load checkpoint `path` into the prepared objects (its own layout's state, or the portable
    state when it was written under another) and return the counters to continue from."""
    accelerator = backend.accelerator
    saved = checkpoint.read_state(path, rows)
    moved = check_resumable(saved, now, path, recipe.resume_new_global_batch, recipe.resume_accept_changed)
    state = checkpoint.load(backend, path, now, moved, model, optimizer, scheduler, rows)
    accelerator.print(f"resumed from {path} at step {state.step}" + (
        f" (written by {saved.world_size} process(es) under {saved.layout or saved.launch}: its portable state)"
        if moved else ""))
    if saved.global_batch != now.global_batch:
        epoch, seen = state.data_position
        accelerator.print(f"resume: global batch {saved.global_batch} -> {now.global_batch} "
                          f"(resume_new_global_batch): the data continues at sample {seen} of epoch {epoch}, "
                          f"the schedule at optimizer step {state.step}")
    return state


def record_launch(recipe: Recipe, state: checkpoint.TrainerState, ds_config: dict | None, resumed_from: Path | None,
                  summary: list[str]) -> list[str]:
    """Main process, before the first step: under overwrite=true the earlier run's files removed
    (only now, every check passed), then the resolved recipe, this launch's manifest entry, and on
    resume the metrics a killed run logged after its checkpoint dropped. Returns what was removed."""
    out = Path(recipe.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    removed = clear_for_overwrite(out) if recipe.overwrite and recipe.resume is None else []
    (out / "config.yaml").write_text(dump_recipe(recipe))
    write_manifest(out / "manifest.json", recipe, state, ds_config, resumed_from=resumed_from, summary=summary)
    for rows in ("metrics.jsonl", "completions.jsonl"):
        keep_metrics_until(out / rows, state.step if resumed_from is not None else -1)
    return removed


def keep_metrics_until(path: Path, step: int) -> None:
    """On resume, drop the rows (metrics.jsonl's, completions.jsonl's) a killed run logged after its
    last checkpoint (and a row the kill cut short: it cannot be read, and was written after the
    checkpoint anyway)."""
    if not path.exists():
        return

    def step_of(line: str) -> float:
        try:
            row = json.loads(line)
            return row["step"] if isinstance(row, dict) and isinstance(row.get("step"), int) else math.inf
        except ValueError:
            return math.inf

    tmp = path.with_name(path.name + ".tmp")
    with open(path, errors="replace") as rows, open(tmp, "w") as kept:  # line by line: completions.jsonl is large
        for line in rows:
            if line.strip() and step_of(line) <= step:
                kept.write(line.rstrip("\n") + "\n")
    tmp.replace(path)


def write_manifest(path: Path, recipe: Recipe, state: checkpoint.TrainerState, ds_config: dict | None,
                   resumed_from: Path | None, summary: list[str] = ()) -> None:
    """What this run was: resolved configs, versions, commit, launch; one entry per launch."""
    import importlib.metadata as md
    import os
    import platform
    import subprocess

    manifest = json.loads(path.read_text()) if path.exists() else {"launches": []}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    versions = {}
    for name in ("toolkit", "torch", "accelerate", "deepspeed", "transformers", "peft", "datasets"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    manifest.update(recipe=recipe.to_dict(), global_batch_size=state.global_batch, world_size=state.world_size,
                    dataset_fingerprint=state.data_fingerprint, inputs=state.inputs)
    manifest["launches"].append({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": sys.argv, "launch": state.launch,
        "world_size": state.world_size, "layout": state.layout, "summary": list(summary),
        "resumed_from": str(resumed_from) if resumed_from else None,
        "accelerate_env": {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))},
        "deepspeed_config": ds_config, "versions": versions, "git_commit": commit, "python": platform.python_version(),
        "host": platform.node()})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, default=str))
    tmp.replace(path)


def save_preset_base(config, weights: dict, tokenizer, path: Path) -> None:
    """The preset's initial weights as a Hugging Face folder (the base a LoRA adapter loads onto)."""
    from transformers import LlamaForCausalLM

    if path.exists():
        return
    base = LlamaForCausalLM(config).to(next(iter(weights.values())).dtype)  # as loaded (model.dtype)
    base.load_state_dict(weights)
    tmp = path.with_name(path.name + ".tmp")  # complete or absent: a killed write is never taken for the base
    shutil.rmtree(tmp, ignore_errors=True)
    base.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
