"""How a run stops on purpose: preemption by a signal, or a loss that stays non-finite. Each ends
with one line and a documented exit code. Light imports only: the CLI installs the signal
handler before it imports torch."""

from __future__ import annotations

import contextlib
import os
import signal
import time

EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again; resume=auto continues from the saved checkpoint


class TrainingStopped(Exception):
    """The run stopped on purpose (preemption, non-finite loss): one line and a documented exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Preemption:
    """SIGTERM or SIGINT. Before the loop (loading, tokenizing): stop at once with one line and exit
    EXIT_PREEMPTED, nothing having been trained. In the loop (`arm`): finish the optimizer step,
    save a checkpoint, exit EXIT_PREEMPTED. A second signal more than 2 s after the first aborts at
    once (a launcher relaying the same Ctrl-C or SIGTERM to its workers within that window counts
    as the same request). Inside `deferred()` (the final save) a signal waits for the block to end.
    The handler only records and writes with os.write: it may interrupt anything, including tqdm
    holding its lock. A process forked from this one (a tokenizing worker of `datasets`) inherits
    the handler; there it ends that worker at once, quietly: its parent stops the work."""

    def __init__(self):
        self.requested_at: float | None = None
        self.signal_name = ""
        self.armed = False
        self.deferring = 0
        self.raised: TrainingStopped | None = None  # the stop this handler raised, wherever it landed
        self.owner = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    @contextlib.contextmanager
    def deferred(self):
        """A block that a signal does not interrupt (it is recorded: `requested`)."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def cause_of(self, error: BaseException) -> TrainingStopped | None:
        """The stop behind `error` when this handler raised one: library code it interrupted (a
        `datasets` pool being torn down, a loader) may have replaced it with an error of its own."""
        return self.raised

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self.owner:  # a forked worker: no line, no exception inside its pool's machinery
            os._exit(128 + signum)
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.requested_at is not None and now - self.requested_at > 2.0:
            os.write(2, f"\n{name} again: aborting at once; resume=auto continues from the last checkpoint\n".encode())
            os._exit(128 + signum)
        if self.requested_at is not None:
            return
        self.requested_at, self.signal_name = now, name
        if self.deferring:
            if int(os.environ.get("RANK", "0")) == 0:
                os.write(2, f"\n{name}: finishing the final save first\n".encode())
            return
        if not self.armed:
            self.raised = TrainingStopped(f"preempted: {name} before training started; nothing was trained or "
                                          "saved. Run again to start over", EXIT_PREEMPTED)
            raise self.raised
        if int(os.environ.get("RANK", "0")) == 0:
            os.write(2, f"\n{name}: stopping after this optimizer step with a checkpoint\n".encode())
