"""Hang watchdog: a thread on every rank that notices when a step, an eval or a save has stopped
moving for far longer than the run's own recent ones took, writes that rank's Python stacks, and
lets the main process say in one line which rank(s) are not where the others are, long before the
collective timeout ends the run.

Moving is what a hang is not: this rank reached a new phase or micro-batch, or, where the device is
the CPU, the process used CPU time (a process stuck in a collective, on the file system or waiting
for a worker uses none; a slow step, bf16 emulated on a CPU say, uses all it gets). On a GPU the
host may spin while it waits for the device, so there only the position counts.

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
PHASE_ORDER = {"data": 0, "prepare": 1, "counts": 2, "forward": 3, "backward": 4, "optimizer": 5, "sync": 6}
GATHER_SECONDS = 10.0  # the main process waits this long for the other ranks' reports
BUSY_SHARE = 0.1  # CPU seconds per second (a tenth of a core) that count as computing: a stuck
#                   process uses next to none, a computing one on a crowded host still gets more


class Watchdog:
    """`cpu`: the device is the CPU, so CPU time used means computing. `clock` and `cpu_clock` (wall
    and this process's CPU seconds) are there for a test to drive `look` by hand (`enabled=False`)."""

    def __init__(self, run_dir: Path, rank: int, world: int, is_main: bool, limit: float | None, enabled: bool,
                 cpu: bool = False, clock=time.monotonic, cpu_clock=time.process_time):
        self.folder, self.rank, self.world, self.is_main = run_dir / "hang", rank, world, is_main
        self.limit, self.enabled, self.cpu = limit, enabled, cpu
        self.clock, self.cpu_clock = clock, cpu_clock
        self.every = min(1.0, (limit or FLOOR_SECONDS) / 10)  # seconds between two looks
        self.history: dict[str, list[float]] = {}
        self.unit = None  # (kind, step, started): the step, eval or save now running
        self.where = ("start", 0, "", 0)  # (phase, step, detail, micro-batch): where this rank is
        self.fired = None
        self.seen = (self.where, clock(), cpu_clock())  # at the last look: (where, wall, CPU seconds)
        self.moved_at = clock()  # when this rank was last seen moving
        if enabled:
            threading.Thread(target=self._watch, name="toolkit-watchdog", daemon=True).start()

    # ---- called by the loop
    def begin(self, kind: str, step: int) -> None:
        self.unit = (kind, step, self.clock())

    def at(self, phase: str, step: int, micro: int = 0, detail: str = "") -> None:
        self.where = (phase, step, detail, micro)

    def done(self) -> None:
        if self.unit is None:
            return
        kind, step, started = self.unit
        seconds = self.clock() - started
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
            time.sleep(self.every)
            self.look()

    def look(self) -> None:
        """One look at the work in progress. The main process reports it once it has gone longer than
        its limit without moving; another rank writes its report once the work has run past the
        limit at all, so the main process, stuck waiting for a rank that is slow but moving, hears
        from it."""
        now, cpu, where, unit = self.clock(), self.cpu_clock(), self.where, self.unit
        seen_where, seen_at, seen_cpu = self.seen
        if where != seen_where or (self.cpu and cpu - seen_cpu >= BUSY_SHARE * (now - seen_at)):
            self.moved_at = now
        self.seen = (where, now, cpu)
        if unit is None or unit == self.fired:
            return
        kind, step, started = unit
        limit = self.limit_for(kind)
        still = now - max(started, self.moved_at)  # seconds this work has not moved
        if now - started > limit and (still > limit or not self.is_main):
            self.fired = unit
            try:
                self._report(kind, step, started, limit, still)
            except Exception as e:  # the watchdog must never be what stops a run
                _say(f"watchdog: could not report ({type(e).__name__}: {e})")

    def _report(self, kind: str, step: int, started: float, limit: float, still: float) -> None:
        self.folder.mkdir(exist_ok=True)
        tag = f"{kind}-{step}"
        ran = self.clock() - started
        moving = still <= 5 * self.every
        with open(self.folder / f"{tag}-rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank}: {describe_unit(kind, step)} running {ran:.0f} s, {still:.0f} s of it without "
                    f"moving; in {describe(self.where)}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        frame, collective = main_thread_frame()
        report = {"rank": self.rank, "where": list(self.where), "frame": frame, "collective": collective,
                  "moving": moving, "time": time.time()}
        tmp = self.folder / f".{tag}-rank{self.rank}.json"
        tmp.write_text(json.dumps(report))
        os.replace(tmp, self.folder / f"{tag}-rank{self.rank}.json")
        if not self.is_main:
            return
        if self.world == 1:
            clause = one_process(self.where, frame, self.cpu)
        else:
            reports, deadline = {}, time.monotonic() + GATHER_SECONDS
            while len(reports) < self.world and time.monotonic() < deadline:
                for path in self.folder.glob(f"{tag}-rank*.json"):
                    r = json.loads(path.read_text())
                    reports[r["rank"]] = (tuple(r["where"]), r["frame"], r["collective"], r.get("moving", False))
                time.sleep(0.2)
            clause = who_is_behind(reports, self.world)
        recent = self.history.get(kind)
        ran = self.clock() - started
        _say(f"watchdog: {describe_unit(kind, step)} has run {ran:.0f} s"
             + (" without moving" if still >= ran - 1 else f", the last {still:.0f} s without moving")
             + f" (limit {limit:.0f} s" + (f", recent ones {statistics.median(recent):.2f} s" if recent else "")
             + "): " + clause + f"; Python stacks in {self.folder}/{tag}-rank*.txt")


def one_process(where: tuple, frame: str, cpu: bool) -> str:
    """The clause for a run of one process: it has no collective to wait in, so what can hold it is
    the device, the file system or a data-loading worker (on a CPU host it is not computing either:
    it used no CPU)."""
    return (f"the process is in {describe(where)} at {frame}" + (", using no CPU" if cpu else "")
            + "; with one process no collective is involved: the device, the file system or a data-loading worker "
            + ("is stuck" if cpu else "is stuck, or one operation there runs this long"))


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
    innermost frame, waiting in a collective[, moving]): the rank(s) at the earliest position, or,
    where all are at the same position, the rank(s) not waiting in a collective while the others are
    (said to be moving where each of them was seen moving: slow, not stuck)."""
    silent = [r for r in range(world) if r not in reports]
    groups: dict[tuple, list[int]] = {}
    for rank, (where, *_) in sorted(reports.items()):
        groups.setdefault(tuple(where), []).append(rank)
    working = [r for r, (_, _, collective, *_) in sorted(reports.items()) if not collective]
    if len(groups) == 1 and 0 < len(working) < len(reports):
        (where, _), = groups.items()
        waiting = [r for r in sorted(reports) if r not in working]
        moving = all(reports[r][3:4] == (True,) for r in working)
        text = (f"{_rank_s(working)} {_is(working)} in {describe(where)} at "
                + "; ".join(reports[r][1] for r in working[:2]) + (" (moving: slow, not stuck)" if moving else "")
                + f" while {_ranks(waiting)} {_is(waiting)} waiting in a collective ({reports[waiting[0]][1]})")
    elif len(groups) == 1:
        (where, ranks), = groups.items()
        text = (f"all {len(ranks)} ranks are in {describe(where)} ({reports[ranks[0]][1]}): a collective, the device "
                "or the file system is stuck for all of them" if not silent
                else f"ranks {_ranks(ranks)} are in {describe(where)}")
    else:
        behind = min(groups, key=position)
        others = [(w, rs) for w, rs in groups.items() if w != behind]
        moving = all(reports[r][3:4] == (True,) for r in groups[behind])
        text = (f"rank{'s' if len(groups[behind]) > 1 else ''} {_ranks(groups[behind])} "
                f"{'are' if len(groups[behind]) > 1 else 'is'} still in {describe(behind)}"
                + (" (moving: slow, not stuck)" if moving else "") + " while "
                + "; ".join(f"{_ranks(rs)} {'are' if len(rs) > 1 else 'is'} in {describe(w)}" for w, rs in others)
                + " (waiting for it)")
    if silent:
        text += (f"; rank(s) {_ranks(silent)} did not report within {GATHER_SECONDS:.0f} s (dead, blocked holding "
                 "Python's lock, or on a node that does not share the output folder)")
    return text


def position(where: tuple) -> tuple:
    phase, step, _, micro = where
    order = PHASE_ORDER.get(phase, 10)
    bucket = PHASE_ORDER["forward"] if phase in ("forward", "backward") else order  # each micro-batch's in turn
    return (step, bucket, micro if bucket == PHASE_ORDER["forward"] else 0, order)


def describe(where: tuple) -> str:
    """A rank's place in words. `prepare` is the objective's work on the batch before the loss: its `detail` says
    what that is (objectives.Preparation.doing), as the objective puts it."""
    phase, step, detail, micro = where
    if phase == "prepare":
        return f"{detail or 'the objective preparing the batch'} of step {step}"
    what = {"forward": f"the forward of micro-batch {micro + 1}",
            "backward": f"the backward of micro-batch {micro + 1}",
            "data": "waiting for data",
            "counts": "the reduction of token counts", "optimizer": "the optimizer step",
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
