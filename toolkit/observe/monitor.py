"""Everything that watches a run without changing what it learns, behind one object the loop calls
at named points: the hang watchdog (where each rank is), the step clock (time per phase, for the
step profile), the profiler trace of train.profile_steps, metrics.jsonl and the trackers, and the
time spent outside steps. `with monitor.phase("forward", step, micro):` marks where a rank is for
the watchdog and, when the block ends, laps the clock."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from ..storage import disk
from . import measure
from .watchdog import Watchdog


class MetricsLog:
    """metrics.jsonl: one JSON object per optimizer step (and the step-0 eval), main process only;
    the numbers also go to the trackers of train.report_to."""

    def __init__(self, path: Path, accelerator):
        self.path, self.accelerator, self.enabled = path, accelerator, accelerator.is_main_process

    def write(self, row: dict) -> dict:
        if self.enabled:
            with disk.writing("metrics", self.path, remove=False), open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.accelerator.trackers:
                scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                           and k not in ("step", "time")}
                scalars.update({f"peak_memory_gib/rank{i}": v for i, v in enumerate(row.get("peak_memory_gib", []))})
                self.accelerator.log(scalars, step=row["step"])
        return row


class Monitor:
    def __init__(self, accelerator, run_dir: Path, watchdog: Watchdog, profile_steps: list[int] | None,
                 first_step: int):
        self.watchdog, self.first_step = watchdog, first_step
        self.clock = measure.StepClock(accelerator.device)
        self.trace = measure.Trace(profile_steps, run_dir, accelerator.process_index, accelerator.device)
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", accelerator)
        self.outside = {"eval": 0.0, "checkpoints": 0.0}  # seconds spent outside steps, for the step profile

    def begin_step(self, step: int) -> None:
        self.watchdog.begin("step", step)
        self.clock.start(step, self.first_step)
        self.trace.before(step)

    @contextlib.contextmanager
    def phase(self, name: str, step: int, micro: int = 0, lap: str | None = None, detail: str = ""):
        """A phase of a step: the watchdog knows this rank is in it (`detail`: what it does there, in
        words); its time goes to the step profile under `lap` (default `name`) when it ends."""
        self.watchdog.at(name, step, micro, detail)
        yield
        self.clock.lap(lap or name)

    def end_step(self, step: int) -> tuple[float, str | None]:
        """(the step's wall time, the profiler's line when its trace was just written)."""
        elapsed = self.clock.end()
        self.watchdog.done()
        return elapsed, self.trace.after(step)

    @contextlib.contextmanager
    def outside_steps(self, kind: str, step: int, counted_as: str):
        """Work between steps (eval, a checkpoint): watched for hangs, its time kept for the profile."""
        began = time.perf_counter()
        self.watchdog.begin(kind, step)
        try:
            yield
        finally:
            self.watchdog.done()
            self.outside[counted_as] += time.perf_counter() - began

    def profile_report(self, gradient_checkpointing: bool, preparation=None) -> tuple[str, dict]:
        return measure.profile_report(self.clock, self.outside, gradient_checkpointing, preparation)
