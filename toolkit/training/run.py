"""A training run from start to end: choose the backend from the launch, hold the run folder's
lock, `build` the run (`build.py`), `fit` it and save `final/` (`loop.py`), and end the trackers and
the backend in the order every backend needs, whatever the end.
"""

from __future__ import annotations

from pathlib import Path

from .. import backends
from ..config import Recipe
from ..stops import Preemption, TrainingStopped
from ..storage import run_folder
from .build import build
from .loop import fit, save_final


def run(recipe: Recipe, source: str = "recipe", preemption: Preemption | None = None) -> dict:
    """Train as the recipe says; returns the last metrics row. `preemption`: the signal handler,
    installed by the CLI before the slow imports so that a signal at any moment gets its line.
    The run holds `output_dir`'s lock from the start to the end, whatever the end."""
    out = Path(recipe.output_dir)
    preemption = preemption or Preemption()
    backend = backends.for_launch()
    backend.make_accelerator(recipe, source)
    lock = run_folder.RunLock(out)
    try:
        return _run(backend, recipe, preemption, lock)
    finally:
        lock.release()  # also on a refusal: the folder is as it was (removed again if this run made it)


def _run(backend: backends.Backend, recipe: Recipe, preemption: Preemption, lock: run_folder.RunLock) -> dict:
    accelerator = backend.accelerator
    run, tokenizer = build(backend, recipe, preemption, lock)
    try:
        preemption.arm()  # from here a signal finishes the step and saves a checkpoint
        last = fit(run)
        save_final(run, tokenizer)
    except TrainingStopped:  # every rank stops here together: at the same step, or a save that did not read back
        preemption.disarm()
        end_trackers(accelerator)
        # A stop skipping this left a gloo thread to die in a C++ destructor at exit: "terminate called
        # without an active exception", SIGABRT instead of the stop's code (ZeRO-3 save read-back, CI 2026-11-26)
        backend.teardown()
        raise
    finally:
        run.objective.close()  # online RL's vLLM server, whatever the end
    end_trackers(accelerator)
    backend.teardown()
    return last


def end_trackers(accelerator) -> None:
    """Flush and close the trackers (accelerate's end_training would also tear down the process group,
    which the backend's teardown does in the order each backend needs)."""
    for tracker in accelerator.trackers:
        tracker.finish()
