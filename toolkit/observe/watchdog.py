"""Hang watchdog: a thread on every rank that notices when a step, an eval or a save runs far longer
than the run's own recent ones, writes that rank's Python stacks, and lets the main process say in
one line which rank(s) are not where the others are, long before the collective timeout ends the run.

The loop only sets `where` (a tuple assignment, no I/O, no collective). Ranks report through files
in RUN_DIR/hang/ rather than a collective: a collective is exactly what a stuck rank cannot join.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

FLOOR_SECONDS = 120.0  # never sooner than this without a set limit: slow first steps are not hangs
FACTOR = 20.0  # ... and not before this many times the recent median of the same kind of work
FIRST_SECONDS = 600.0  # the first of a kind (compile, allocator warm-up, first save) has no history
PHASE_ORDER = {"data": 0, "counts": 1, "forward": 2, "backward": 3, "optimizer": 4, "sync": 5}
GATHER_SECONDS = 10.0  # the main process waits this long for the other ranks' reports


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world: int, is_main: bool, limit: float | None, enabled: bool):
        self.folder, self.rank, self.world, self.is_main = run_dir / "hang", rank, world, is_main
        self.limit, self.enabled = limit, enabled
        self.history: dict[str, list[float]] = {}
        self.unit = None  # (kind, step, started): the step, eval or save now running
        self.where = ("start", 0, "", 0)  # (phase, step, detail, micro-batch): where this rank is
        self.fired = None
        if enabled:
            threading.Thread(target=self._watch, name="toolkit-watchdog", daemon=True).start()

    # ---- called by the loop
    def begin(self, kind: str, step: int) -> None:
        self.unit = (kind, step, time.monotonic())

    def at(self, phase: str, step: int, micro: int = 0, detail: str = "") -> None:
        self.where = (phase, step, detail, micro)

    def done(self) -> None:
        if self.unit is None:
            return
        kind, step, started = self.unit
        seconds = time.monotonic() - started
        self.history.setdefault(kind, []).append(seconds)
        self.history[kind] = self.history[kind][-20:]
        if self.fired == self.unit and self.is_main:
            _say(f"watchdog: {describe_unit(kind, step)} finished after {seconds:.0f} s")
        self.unit = None

    # ---- the thread
    def limit_for(self, kind: str) -> float:
        if self.limit:
            return self.limit
        past = self.history.get(kind)
        return max(FLOOR_SECONDS, FACTOR * statistics.median(past)) if past else FIRST_SECONDS

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, (self.limit or FLOOR_SECONDS) / 10))
            unit = self.unit
            if unit is None or unit == self.fired:
                continue
            kind, step, started = unit
            limit = self.limit_for(kind)
            if time.monotonic() - started > limit:
                self.fired = unit
                try:
                    self._report(kind, step, started, limit)
                except Exception as e:  # the watchdog must never be what stops a run
                    _say(f"watchdog: could not report ({type(e).__name__}: {e})")

    def _report(self, kind: str, step: int, started: float, limit: float) -> None:
        self.folder.mkdir(exist_ok=True)
        tag = f"{kind}-{step}"
        phase, at_step, detail, micro = self.where
        with open(self.folder / f"{tag}-rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank}: {describe_unit(kind, step)} running {time.monotonic() - started:.0f} s; "
                    f"in {describe(self.where)}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        frame, collective = main_thread_frame()
        report = {"rank": self.rank, "where": list(self.where), "frame": frame, "collective": collective,
                  "time": time.time()}
        tmp = self.folder / f".{tag}-rank{self.rank}.json"
        tmp.write_text(json.dumps(report))
        os.replace(tmp, self.folder / f"{tag}-rank{self.rank}.json")
        if not self.is_main:
            return
        reports, deadline = {}, time.monotonic() + GATHER_SECONDS
        while len(reports) < self.world and time.monotonic() < deadline:
            for path in self.folder.glob(f"{tag}-rank*.json"):
                r = json.loads(path.read_text())
                reports[r["rank"]] = (tuple(r["where"]), r["frame"], r["collective"])
            time.sleep(0.2)
        recent = self.history.get(kind)
        _say(f"watchdog: {describe_unit(kind, step)} has run {time.monotonic() - started:.0f} s (limit {limit:.0f} s"
             + (f", recent ones {statistics.median(recent):.2f} s" if recent else "") + "): "
             + who_is_behind(reports, self.world) + f"; Python stacks in {self.folder}/{tag}-rank*.txt")


def main_thread_frame() -> tuple[str, bool]:
    """Where the main thread is ('file:line in function') and whether it waits in a collective."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "unknown", False
    code = frame.f_code
    where = f"{'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno} in {code.co_name}"
    return where, any(part in code.co_filename for part in COLLECTIVE_FILES)


# Python files whose innermost frame means "inside a collective" (DDP's forward broadcasts buffers).
COLLECTIVE_FILES = ("torch/distributed/", "torch/nn/parallel/distributed.py", "deepspeed/comm/",
                    "accelerate/utils/operations.py")


def who_is_behind(reports: dict[int, tuple], world: int) -> str:
    """One clause naming the rank(s) not where the others are, from each rank's (position,
    innermost frame, waiting in a collective): the rank(s) at the earliest position, or, where all
    are at the same position, the rank(s) not waiting in a collective while the others are."""
    silent = [r for r in range(world) if r not in reports]
    groups: dict[tuple, list[int]] = {}
    for rank, (where, _, _) in sorted(reports.items()):
        groups.setdefault(tuple(where), []).append(rank)
    working = [r for r, (_, _, collective) in sorted(reports.items()) if not collective]
    if len(groups) == 1 and 0 < len(working) < len(reports):
        (where, _), = groups.items()
        waiting = [r for r in sorted(reports) if r not in working]
        text = (f"{_rank_s(working)} {_is(working)} in {describe(where)} at "
                + "; ".join(reports[r][1] for r in working[:2])
                + f" while {_ranks(waiting)} {_is(waiting)} waiting in a collective ({reports[waiting[0]][1]})")
    elif len(groups) == 1:
        (where, ranks), = groups.items()
        text = (f"all {len(ranks)} ranks are in {describe(where)} ({reports[ranks[0]][1]}): a collective, the device "
                "or the file system is stuck for all of them" if not silent
                else f"ranks {_ranks(ranks)} are in {describe(where)}")
    else:
        behind = min(groups, key=position)
        others = [(w, rs) for w, rs in groups.items() if w != behind]
        text = (f"rank{'s' if len(groups[behind]) > 1 else ''} {_ranks(groups[behind])} "
                f"{'are' if len(groups[behind]) > 1 else 'is'} still in {describe(behind)} while "
                + "; ".join(f"{_ranks(rs)} {'are' if len(rs) > 1 else 'is'} in {describe(w)}" for w, rs in others)
                + " (waiting for it)")
    if silent:
        text += (f"; rank(s) {_ranks(silent)} did not report within {GATHER_SECONDS:.0f} s (dead, blocked holding "
                 "Python's lock, or on a node that does not share the output folder)")
    return text


def position(where: tuple) -> tuple:
    phase, step, _, micro = where
    order = PHASE_ORDER.get(phase, 10)
    bucket = 2 if phase in ("forward", "backward") else order  # forward and backward of each micro-batch in turn
    return (step, bucket, micro if bucket == 2 else 0, order)


def describe(where: tuple) -> str:
    phase, step, detail, micro = where
    what = {"forward": f"the forward of micro-batch {micro + 1}",
            "backward": f"the backward of micro-batch {micro + 1}",
            "data": "waiting for data", "counts": "the reduction of token counts", "optimizer": "the optimizer step",
            "sync": "the reduction of the loss"}.get(phase, phase)
    return f"{what} of step {step}" + (f" ({detail})" if detail else "")


def describe_unit(kind: str, step: int) -> str:
    return {"step": f"step {step}", "eval": f"the evaluation at step {step}",
            "checkpoint": f"the checkpoint at step {step}", "save": "the final save"}.get(kind, f"{kind} {step}")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _rank_s(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"


def _is(ranks: list[int]) -> str:
    return "are" if len(ranks) > 1 else "is"


def _say(line: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)  # above the progress bar, not inside it
