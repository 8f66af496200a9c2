"""Checkpoints: the full training state, written atomically, found again on resume.

Layout: `output_dir/checkpoints/step-000012/` holds accelerate's state (the trained weights,
optimizer, scheduler, loss scaler; sharded the way the backend shards it), every rank's RNG
states and `trainer_state.json` (counters, data position, what the run was launched with). Frozen
weights (a LoRA adapter's base) are not in it: a resume builds them again from the recipe, as the
portable state assumes (`backend.save_state`; FSDP1 still writes them, see backends/fsdp.py).
A checkpoint is written as `.tmp-step-000012` by all ranks, marked complete by the main process
(`COMPLETE`) and only then renamed into place, so a folder named `step-*` without the marker is
never produced by a finished write and is never loaded.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .. import faults
from ..errors import EXIT_SAVE_MISMATCH, ToolkitError
from ..stops import TrainingStopped
from . import disk, portable
from .verify import corrupt_checkpoint

MARKER = "COMPLETE"
STATE = "trainer_state.json"
NAME = re.compile(r"^step-(\d+)$")


@dataclass
class TrainerState:
    """Counters and launch facts saved with every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    nonfinite_in_a_row: int = 0
    world_size: int = 1
    global_batch: int = 0
    launch: str = "single"
    data_fingerprint: str = ""
    data_content: str = ""
    """The training data's fingerprint without its files' paths (older checkpoints lack it: then the
    path-bound data_fingerprint decides)."""
    recipe: dict | None = None
    layout: str = ""
    """How the training state is sharded on disk (the backend's `layout()`); empty in old checkpoints."""
    data_position: list[int] = field(default_factory=lambda: [0, 0])
    """[epoch, samples of its permutation seen]; older checkpoints lack it (then: from step x global batch)."""
    inputs: dict | None = None
    """{input: content fingerprint} of what the run learns from besides its data (storage/inputs.py: the base
    model, the reward functions' code); older checkpoints lack it (then nothing is compared)."""


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / STATE).is_file()


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := NAME.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def find_resume(resume: str | None, output_dir: Path) -> Path | None:
    """The checkpoint to resume from: None (fresh start), `auto` (latest complete one in
    output_dir, if any) or a path that must be a complete checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ToolkitError(f"resume: {resume}: folder not found")
    if not is_complete(path):
        latest = complete_checkpoints(path)  # a run folder given instead of a checkpoint
        if latest:
            return latest[-1]
        raise ToolkitError(f"resume: {resume} has no complete checkpoint (no {MARKER} marker); "
                           "it was interrupted while being written")
    return path


def tidy(output_dir: Path) -> list[str]:
    """Finish or undo what a killed `save` or `disk.replace_dir` left behind (main process, before any
    rank looks for a checkpoint). A complete `.tmp-` write whose rename never happened is moved
    into place; everything else half-done is removed. Returns what was done, for the log."""
    done = []
    out = Path(output_dir)
    root = checkpoint_dir(out)
    for tmp in sorted(root.glob(".tmp-step-*")) if root.is_dir() else []:
        final = tmp.with_name(tmp.name[len(".tmp-"):])
        if is_complete(tmp) and not final.exists():
            os.rename(tmp, final)
            done.append(f"completed {final.name}, whose rename into place was interrupted")
        else:
            shutil.rmtree(tmp)
            done.append(f"removed {tmp.name}, an interrupted checkpoint write")
    for old in sorted(root.glob(".del-step-*")) if root.is_dir() else []:
        shutil.rmtree(old)
        done.append(f"removed {old.name}, an interrupted deletion")
    for name in ("final", "base-model"):
        old, tmp = out / f".del-{name}", out / f"{name}.tmp"
        if old.exists() and not (out / name).exists():
            os.rename(old, out / name)  # killed between the two renames of replace_dir: the old one stands
            done.append(f"restored {name}/, whose replacement was interrupted")
        for leftover in (old, tmp):
            if leftover.exists():
                shutil.rmtree(leftover)
                done.append(f"removed {leftover.name}, an interrupted save")
    return done


def read_state(path: Path, rows: int | None = None) -> TrainerState:
    """A checkpoint's counters; `rows` (the training set's size) places an older checkpoint, which
    did not record its data position, in its epoch."""
    fields = json.loads((Path(path) / STATE).read_text())
    if "data_position" not in fields and rows:
        per_epoch = rows // fields["global_batch"]
        fields["data_position"] = [fields["step"] // per_epoch, fields["step"] % per_epoch * fields["global_batch"]]
    return TrainerState(**fields)


def save(backend, path_final: Path, state: TrainerState, config, model, optimizer, scheduler,
         objective_state=None) -> dict:
    """Write a checkpoint from every rank; visible under its final name only once complete: the
    backend's own state, the portable state (`config.portable`), every rank's RNG and what
    `objective_state(folder)` writes (the objective's own, on every rank). Each rank's
    share is read back (the backend's `checkpoint_problem`, and the portable files on the main process):
    a checkpoint any rank cannot read back as it was saved is never marked complete, and the run
    stops. Returns the seconds each part took (main process's clock)."""
    accelerator = backend.accelerator
    seconds, started = {}, time.perf_counter()
    tmp = path_final.with_name(".tmp-" + path_final.name)
    kept = complete_checkpoints(path_final.parent.parent)
    needed = disk.size_of(kept[-1]) if kept else None  # the same write as last time
    with disk.writing(f"checkpoint {path_final.name}", tmp, needed):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # left over by a write that was killed
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        backend.save_state(model, tmp)  # what is trained, optimizer, scheduler, scaler (frozen weights: the recipe's)
        seconds["backend state"] = time.perf_counter() - started
        written = None
        if config.portable:
            written = portable.save(backend, model, optimizer, scheduler, tmp)
            seconds["portable"] = time.perf_counter() - started - seconds["backend state"]
        with open(tmp / f"rng_rank{accelerator.process_index}.pkl", "wb") as f:
            pickle.dump(rng_states(), f)
        if objective_state is not None:
            objective_state(tmp)
        pause = float(os.environ.get("TOOLKIT_FAULT_CHECKPOINT_PAUSE", "0"))  # test seam: a slow write
        if pause:
            time.sleep(pause)
        faults.at("checkpoint")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            corrupt_checkpoint(tmp)  # test seam, off unless asked
        accelerator.wait_for_everyone()
        read_from = time.perf_counter()
        problem = backend.checkpoint_problem(model, optimizer, tmp) or portable.files_problem(tmp, written)
        del written
        _stop_unless_read_back(accelerator, problem, path_final)
        seconds["read-back"] = time.perf_counter() - read_from
        if accelerator.is_main_process:
            (tmp / STATE).write_text(json.dumps(asdict(state), indent=1))
            (tmp / MARKER).write_text(f"step {state.step}\n")
            _fsync_dir(tmp)
            disk.replace_dir(tmp, path_final)  # the same step may be saved again (a resumed run that had nothing left)
            _fsync_dir(path_final.parent)
            for old in complete_checkpoints(path_final.parent.parent)[:-config.keep_last]:
                doomed = old.with_name(".del-" + old.name)  # out of sight first, so never half-deleted
                os.rename(old, doomed)
                shutil.rmtree(doomed)
    accelerator.wait_for_everyone()
    seconds["total"] = time.perf_counter() - started
    return seconds


def _stop_unless_read_back(accelerator, problem: str | None, path_final: Path) -> None:
    """Every rank learns every rank's verdict; any problem stops them all, in one line."""
    from accelerate.utils import gather_object

    verdicts = gather_object([problem]) if accelerator.num_processes > 1 else [problem]
    bad = [(rank, p) for rank, p in enumerate(verdicts) if p]
    if bad:
        rank, p = bad[0]
        raise TrainingStopped(f"checkpoint {path_final.name} did not read back as saved (rank {rank}: {p}); it was "
                              "not marked complete, so resume=auto uses the previous one", EXIT_SAVE_MISMATCH)


def _stop_unless_loaded(accelerator, problem: str | None, path: Path) -> None:
    from accelerate.utils import broadcast_object_list

    verdict = [problem]
    if accelerator.num_processes > 1:
        broadcast_object_list(verdict)  # the main process compared; every rank stops, or none does
    if verdict[0]:
        raise ToolkitError(f"resume: the portable state of {path} did not load as saved into this launch "
                           f"({verdict[0]})")
    if accelerator.is_main_process:
        print(f"resume: the portable state of {path.name} loaded and read back as saved (weights, AdamW moments "
              "and step, learning rates, scheduler)", file=sys.stderr)


def load(backend, path: Path, now: TrainerState, moved: bool, model, optimizer, scheduler,
         rows: int | None = None) -> TrainerState:
    """Restore what `save` wrote, on every rank, including this rank's RNG states; returns its
    counters with this launch's facts (`now`: process count, layout, recipe). `moved`: the
    checkpoint was written under another layout (backend or process count): the portable state
    is loaded, and a rank that did not exist then takes rank 0's RNG states (as every rank of a
    fresh run starts from the same seed)."""
    accelerator = backend.accelerator
    if moved:
        portable.load(backend, model, optimizer, scheduler, path)
        _stop_unless_loaded(accelerator, portable.read_back(backend, model, optimizer, scheduler, path), path)
        seen = os.environ.get("TOOLKIT_FAULT_PORTABLE_AFTER_LOAD")  # test seam: what this launch holds now
        if seen:
            portable.save(backend, model, optimizer, scheduler, Path(seen))
    else:
        backend.load_state(model, path)
    rng = Path(path) / f"rng_rank{accelerator.process_index}.pkl"
    if moved and not rng.is_file():
        rng = Path(path) / "rng_rank0.pkl"
    if not rng.is_file():
        raise ToolkitError(f"resume: {path} has no RNG state for rank {accelerator.process_index}")
    with open(rng, "rb") as f:
        set_rng_states(pickle.load(f))
    saved = read_state(path, rows)
    return replace(now, step=saved.step, tokens_seen=saved.tokens_seen, skipped_steps=saved.skipped_steps,
                   nonfinite_in_a_row=saved.nonfinite_in_a_row, data_position=saved.data_position)


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    # Our own, because accelerate's restore fails on a CPU-only host (it reaches the CUDA calls)
    # and only logs "Could not load random states".
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
