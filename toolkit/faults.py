"""Fault-injection seams for the fault matrix (tests/test_faults.py), read once from the
environment. Off unless asked; each costs a dictionary lookup where it sits.

`TOOLKIT_FAULT_SIGNAL=PHASE:SIGNAL[:DELAY[:REPEAT[:PAUSE]]]` sends SIGNAL (TERM, INT, KILL) to
this process's group when the run reaches PHASE, DELAY seconds later (a timer, so the signal lands
inside the phase's work, e.g. while `datasets` workers tokenize), again REPEAT seconds after that
(a second Ctrl-C), and makes the phase take PAUSE seconds longer (a slow save, still running when
the second signal comes). Phases: `data` (tokenizing), `model` (loading), `prepare`, `step`
(the forward of the first micro-batch of optimizer step 2), `generate` (online RL sampling the
completions of optimizer step 2), `tool` (online RL's tool rounds of optimizer step 2 starting), `eval`,
`checkpoint` (its files
written, not yet marked complete), `final` (the final save's folder written, not yet renamed),
`merge` and `convert` (their output written, not yet renamed). The group is what a terminal's
Ctrl-C reaches; a test runs each launch in a session of its own.
"""

from __future__ import annotations

import os
import signal
import threading
import time

SIGNALS = {"TERM": signal.SIGTERM, "INT": signal.SIGINT, "KILL": signal.SIGKILL}
PHASES = ("data", "model", "prepare", "step", "generate", "tool", "eval", "checkpoint", "final", "merge", "convert",
          "export")


class Faults:
    def __init__(self, raw: str | None = None):
        raw = os.environ.get("TOOLKIT_FAULT_SIGNAL", "") if raw is None else raw
        self.phase = self.signal = None
        self.delay = self.repeat = self.pause = 0.0
        if raw:
            parts = raw.split(":")
            self.phase, self.signal = parts[0], SIGNALS[parts[1]]
            self.delay = float(parts[2]) if len(parts) > 2 else 0.0
            self.repeat = float(parts[3]) if len(parts) > 3 else 0.0
            self.pause = float(parts[4]) if len(parts) > 4 else 0.0
            if self.phase not in PHASES:
                raise ValueError(f"TOOLKIT_FAULT_SIGNAL: unknown phase {self.phase}")

    def at(self, phase: str) -> None:
        """The run has reached `phase`: send the signal if this is the one asked for (once)."""
        if phase != self.phase or int(os.environ.get("RANK", "0")) != 0:
            return
        self.phase = None  # once
        sig, repeat = self.signal, self.repeat

        def send():
            os.killpg(os.getpgrp(), sig)
            if repeat:
                again = threading.Timer(repeat, lambda: os.killpg(os.getpgrp(), sig))
                again.daemon = True
                again.start()

        if self.delay:
            timer = threading.Timer(self.delay, send)
            timer.daemon = True
            timer.start()
        else:
            send()
        if self.pause:
            time.sleep(self.pause)


FAULTS = Faults()  # read once, at import


def at(phase: str) -> None:
    FAULTS.at(phase)


class LoopSeams:
    """Seams inside the training step, read once from the environment (off unless set):
    TOOLKIT_FAULT_HANG=RANK:STEP:SECONDS makes that rank sleep before the forward of that step's
    first micro-batch, as a rank stuck in its own work would; TOOLKIT_FAULT_SLOW_OP=RANK:STEP:SECONDS
    makes it run one torch op of about SECONDS there instead (after the `step` phase's signal is
    scheduled), as a bf16 backward on a CPU does: Python runs no signal handler until it returns;
    TOOLKIT_FAULT_NONFINITE_STEPS=3,4 makes those optimizer steps' loss NaN on every rank, so the real
    skip / loss-scale / stop machinery runs on real NaN gradients."""

    def __init__(self, env=None):
        env = os.environ if env is None else env
        raw = env.get("TOOLKIT_FAULT_HANG")
        self.hang = tuple(float(x) for x in raw.split(":")) if raw else None  # (rank, step, seconds)
        raw = env.get("TOOLKIT_FAULT_SLOW_OP")
        self.slow_op = tuple(float(x) for x in raw.split(":")) if raw else None  # (rank, step, seconds)
        self.nonfinite_steps = {int(x) for x in env.get("TOOLKIT_FAULT_NONFINITE_STEPS", "").split(",") if x.strip()}


SEAMS = LoopSeams()


def injected_hang(seconds: float) -> None:
    time.sleep(seconds)  # named so: the watchdog's report shows the hung rank in here


def injected_slow_op(seconds: float) -> None:
    """One torch op that runs about `seconds` (timed on this host, now) and returns to Python only
    then: a sum over a broadcast view, so it needs no memory. It releases the GIL, as torch's ops do."""
    import torch  # here: the ground modules stay light (the CLI imports them before torch)

    one, width = torch.ones((), dtype=torch.float64), 1_000_000
    began = time.perf_counter()
    one.expand(200, width).sum()
    rows = max(1, int(200 * seconds / max(time.perf_counter() - began, 1e-6)))
    os.write(2, f"fault: one torch op of about {seconds:g} s (TOOLKIT_FAULT_SLOW_OP)\n".encode())
    one.expand(rows, width).sum()


def before_forward(step: int, micro: int, rank: int) -> None:
    """The forward of micro-batch `micro` of optimizer step `step` is about to run on `rank`."""
    if micro == 0:
        if SEAMS.hang is not None and SEAMS.hang[:2] == (rank, step):
            injected_hang(SEAMS.hang[2])
        if step == 2:
            at("step")
        if SEAMS.slow_op is not None and SEAMS.slow_op[:2] == (rank, step):
            injected_slow_op(SEAMS.slow_op[2])


def nonfinite(step: int, micro: int) -> bool:
    """Whether this micro-batch's loss is to be made NaN (the first micro-batch of a listed step)."""
    return micro == 0 and step in SEAMS.nonfinite_steps
