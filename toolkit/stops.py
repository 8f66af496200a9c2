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


_ABRUPT = False  # inside Preemption.abrupt(): a process forked now dies with its parent


def _die_with_parent() -> None:
    """In a child forked inside `abrupt()`: the kernel SIGKILLs it when its parent ends (Linux
    PR_SET_PDEATHSIG), so no worker outlives an abrupt exit, even one forked during it."""
    if not _ABRUPT:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_die_with_parent)


def kill_descendants() -> None:
    """SIGKILL every process descended from this one (found in /proc before any is killed)."""
    children: dict[int, list[int]] = {}
    try:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as f:
                        children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
                except (OSError, IndexError, ValueError):
                    continue
    except OSError:
        return
    todo, found = [os.getpid()], []
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


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
    the handler; there it ignores the signal: its parent stops the work and ends its pool (a worker
    that died at once could die holding the pool's queue lock, and the parent's teardown would then
    wait for that lock forever). An abort ends this process's descendants with it."""

    def __init__(self, stop_text: str = "before training started; nothing was trained or saved. Run again to start over"):
        self.stop_text = stop_text  # what a signal before `arm` means, for its one line
        self.requested_at: float | None = None
        self.signal_name = ""
        self.armed = False
        self.deferring = 0
        self.abrupt_cleanups: tuple | None = None  # inside `abrupt()`: what to undo before exiting at once
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

    @contextlib.contextmanager
    def abrupt(self, *cleanups):
        """A block in which library code runs worker processes of its own (`datasets`' map with
        num_proc). A signal here exits at once: its line, `cleanups` (e.g. removing a partial
        folder), this process's descendants killed, exit EXIT_PREEMPTED. Unwinding instead would
        run the library's pool teardown, which can wait forever for a worker the same signal hit."""
        global _ABRUPT
        self.abrupt_cleanups, _ABRUPT = cleanups, True
        try:
            yield
        finally:
            self.abrupt_cleanups, _ABRUPT = None, False

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
        if os.getpid() != self.owner:  # a forked worker: its parent ends it (see the class's note)
            return
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.requested_at is not None and now - self.requested_at > 2.0:
            os.write(2, f"\n{name} again: aborting at once; resume=auto continues from the last checkpoint\n".encode())
            kill_descendants()
            os._exit(128 + signum)
        if self.requested_at is not None:
            return
        self.requested_at, self.signal_name = now, name
        if self.deferring:
            if int(os.environ.get("RANK", "0")) == 0:
                os.write(2, f"\n{name}: finishing the final save first\n".encode())
            return
        if not self.armed:
            self.raised = TrainingStopped(f"preempted: {name} {self.stop_text}", EXIT_PREEMPTED)
            if self.abrupt_cleanups is not None:
                if int(os.environ.get("RANK", "0")) == 0:
                    os.write(2, f"\nstopped: {self.raised}\n".encode())
                for cleanup in self.abrupt_cleanups:
                    try:
                        cleanup()
                    except Exception:  # noqa: BLE001 - exiting regardless; the next run tidies what is left
                        pass
                kill_descendants()
                time.sleep(0.1)
                kill_descendants()  # one a pool's thread forked meanwhile
                os._exit(EXIT_PREEMPTED)
            raise self.raised
        if int(os.environ.get("RANK", "0")) == 0:
            os.write(2, f"\n{name}: stopping after this optimizer step with a checkpoint\n".encode())
