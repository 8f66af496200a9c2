"""How a run stops on purpose: preemption by a signal, or a loss that stays non-finite. Each ends
with one line and a documented exit code. Light imports only: the CLI installs the signal
handler before it imports torch."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from .errors import EXIT_PREEMPTED, EXIT_SIGNAL_BASE, EXIT_USER_ERROR

_ABRUPT = False  # inside Preemption.abrupt(): a process forked now dies with its parent


def _in_forked_child() -> None:
    """In every child forked from this process (`datasets`' tokenizing workers):

    - SIGTERM takes its default action again, so the child ends. `Pool.terminate()`, which a
      pool runs when `map` fails (a full datasets cache, say), holds the task queue's lock and
      ends its workers with SIGTERM. A worker that inherited the preemption handler ignored it
      and waited for that lock forever, and so did the pool's join (seen: 1 in 6 tries here with
      the CPUs busy). A group-wide SIGTERM ending a worker is harmless: the parent then exits
      abruptly (`Preemption.abrupt`) without tearing the pool down.
    - Inside `abrupt()`, the kernel also SIGKILLs the child when its parent ends (Linux
      PR_SET_PDEATHSIG), so no worker outlives an abrupt exit, even one forked during it.
    SIGINT stays with the inherited handler, which ignores it in a child: Ctrl-C is its parent's.
    The child no longer writes the signals it gets to its parent's watcher (`SignalWatcher`): it
    inherited the descriptor, not the thread that reads it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
    if not _ABRUPT:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)


def _descendants(known: set[int]) -> set[int]:
    """Processes descended from this one, found in /proc, plus those of `known` still alive (a
    child's own children move to init once it is gone, and are no longer found by parentage).
    Zombies are left out: they are ended, only not yet reaped."""
    children: dict[int, list[int]] = {}
    alive: set[int] = set()
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return set()
    for name in entries:
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X"):
            alive.add(int(name))
            children.setdefault(int(fields[1]), []).append(int(name))
    todo, found = [os.getpid()], set()
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found | (known & alive)


def _stop_pool_handlers() -> None:
    """Stop every multiprocessing(-like) pool in this process from replacing workers: a pool's
    worker-handler thread forks a new worker for each one that dies, for as long as its state is
    RUN, so killed workers came back as fast as they were killed (seen under load: fresh workers
    alive after the run had exited). The handler's loop ends once its thread's state is TERMINATE,
    the value `Pool.terminate()` sets; multiprocessing and `multiprocess` (datasets) share it."""
    for thread in threading.enumerate():
        if getattr(getattr(thread, "_target", None), "__name__", "") == "_handle_workers":
            thread._state = "TERMINATE"


def kill_descendants(wait_s: float = 3.0) -> None:
    """SIGKILL every process descended from this one and wait (up to `wait_s`) until each has
    ended: a killed process still tears down its memory for a moment, and a pool's thread may fork
    a replacement for a killed worker (it polls every 0.1 s), so the search ends only after two
    empty passes 0.25 s apart. The caller then exits with none of its processes left."""
    _stop_pool_handlers()
    deadline, known, quiet = time.monotonic() + wait_s, set(), 0
    while time.monotonic() < deadline:
        found = _descendants(known)
        if not found:
            quiet += 1
            if quiet == 2:
                return
            time.sleep(0.25)
            continue
        quiet = 0
        known |= found
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


class TrainingStopped(Exception):
    """The run stopped on purpose (preemption, non-finite loss): one line and a documented exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def refusal_marker() -> Path | None:
    """In a launch of several processes: the file that says a rank of this launch refused the run (a
    ToolkitError), named for the launcher's agent (the ranks' parent on this machine) and its port. The
    launcher then ends the other ranks with SIGTERM, which must not read as a preemption: they exit
    EXIT_USER_ERROR too (issue 52: TRL's fsdp1.yaml, rank 0 exit 2, rank 1 exit 75)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return Path(tempfile.gettempdir()) / f"toolkit-refused-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}"


def mark_refused() -> None:
    marker = refusal_marker()
    if marker is not None:
        try:
            marker.write_text(str(os.getpid()))
        except OSError:  # a full or read-only temp folder: the other ranks exit as on a signal
            pass


def refused_elsewhere() -> bool:
    marker = refusal_marker()
    return marker is not None and marker.exists()


class Preemption:
    """SIGTERM or SIGINT. Before the loop (loading, tokenizing): stop at once with one line and exit
    EXIT_PREEMPTED, nothing having been trained. In the loop (`arm`): finish the optimizer step,
    save a checkpoint, exit EXIT_PREEMPTED. A second signal more than 2 s after the first aborts at
    once (a launcher relaying the same Ctrl-C or SIGTERM to its workers within that window counts
    as the same request). Inside `deferred()` (the final save) a signal waits for the block to end.
    The handler only records and writes with os.write: it may interrupt anything, including tqdm
    holding its lock. A process forked from this one (a tokenizing worker of `datasets`) ignores
    SIGINT (its parent stops the work and ends it) and ends on SIGTERM, as `Pool.terminate()`
    expects (see `_in_forked_child`). While such workers run, the parent is inside `abrupt()` and
    exits without tearing their pool down. An abort ends this process's descendants with it. A
    thread notes each signal as it arrives (`SignalWatcher`), so the abort is at once even while the
    main thread is inside one long torch op."""

    def __init__(self,
                 stop_text: str = "before training started; nothing was trained or saved. Run again to start over"):
        self.stop_text = stop_text  # what a signal before `arm` means, for its one line
        self.requested_at: float | None = None
        self.signal_name = ""
        self.armed = False
        self.deferring = 0
        self.abrupt_cleanups: tuple | None = None  # inside `abrupt()`: what to undo before exiting at once
        self.raised: TrainingStopped | None = None  # the stop this handler raised, wherever it landed
        self.owner = os.getpid()
        self.acted = False  # the first signal's action (raise, exit, or leave it to the loop) is taken
        self.aborting = False
        self.lock = threading.RLock()  # the watcher thread and the handler (which may nest) record arrivals
        watch(self)
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
        """Python's handler, run by the main thread between two bytecodes (minutes late when the
        signal lands inside one long torch op). It takes the first signal's action; when each signal
        arrived, and so whether a later one aborts, the watcher thread judges as it arrives
        (`arrived`), this handler only where signals do not reach a watcher."""
        if os.getpid() != self.owner:  # a forked worker's SIGINT: its parent ends it (see the class's note)
            return
        self.arrived(signum, time.monotonic(), judge_repeat=WATCHER is None or not WATCHER.attached())
        if self.acted:
            return
        self.acted = True
        if self.deferring or self.armed:  # said by `arrived`; the loop, or the final save, stops by itself
            return
        self.raised = TrainingStopped(f"preempted: {self.signal_name} {self.stop_text}", EXIT_PREEMPTED)
        if self.abrupt_cleanups is not None:
            if int(os.environ.get("RANK", "0")) == 0:
                os.write(2, f"\nstopped: {self.raised}\n".encode())
            self._exit_now(EXIT_PREEMPTED)
        raise self.raised

    def _exit_now(self, code: int) -> None:
        """The abrupt block's cleanups (its partial output), this process's descendants killed, exit `code`."""
        for cleanup in self.abrupt_cleanups or ():
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - exiting regardless; the next run tidies what is left
                pass
        kill_descendants()
        os._exit(code)

    def arrived(self, signum: int, now: float, judge_repeat: bool = True) -> None:
        """Signal `signum` arrived at `now`. The first is the request, said at once where the loop or
        the final save acts on it; one within 2 s of it is the same request; a later one aborts (its
        line, this process's descendants killed, exit 128 + N) from the thread that sees it. Only
        records and writes with os.write: it may interrupt anything, including tqdm holding its lock."""
        name = signal.Signals(signum).name
        with self.lock:
            first = self.requested_at is None
            if first:
                self.requested_at, self.signal_name = now, name
            elif not judge_repeat or now - self.requested_at <= 2.0 or self.aborting:
                return
            else:
                self.aborting = True
        if first and refused_elsewhere():  # another rank refused the run and the launcher is ending this one
            self._exit_now(EXIT_USER_ERROR)
        if not first:
            os.write(2, f"\n{name} again: aborting at once; resume=auto continues from the last checkpoint\n".encode())
            kill_descendants()
            os._exit(EXIT_SIGNAL_BASE + signum)
        if int(os.environ.get("RANK", "0")) != 0:
            return
        if self.deferring:
            os.write(2, f"\n{name}: finishing the final save first\n".encode())
        elif self.armed:
            os.write(2, f"\n{name}: stopping after this optimizer step with a checkpoint\n".encode())


class SignalWatcher:
    """Sees each SIGTERM and SIGINT as it arrives, whatever the main thread is doing.

    Python runs a handler only in the main thread, between two bytecodes, so a second signal waited
    for as long as one torch op ran: over 2 minutes inside a bf16 backward on a CPU host (issue 45),
    where the abort must be at once. The interpreter's C-level handler also writes the number of
    each signal, as it arrives, to the descriptor `signal.set_wakeup_fd` names; this thread reads it
    and hands each arrival to the current `Preemption`. torch's ops and autograd's backward release
    the GIL (a thread ticked on throughout a long sum, matmul and backward here), so this thread
    runs while they do. tests/test_faults.py::test_a_second_sigterm_inside_a_long_torch_op_aborts_at_once
    guards it."""

    def __init__(self):
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)  # the C-level handler must never block (a full buffer drops a byte)
        signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)  # ValueError off the main thread
        self.current: Preemption | None = None
        threading.Thread(target=self.read, name="toolkit-signals", daemon=True).start()

    def attached(self) -> bool:
        """Whether signals still reach this watcher: a library may have set a wakeup descriptor of its
        own since (asyncio does), which is then left in place. Main thread only."""
        ours = self.writer.fileno()
        previous = signal.set_wakeup_fd(ours, warn_on_full_buffer=False)
        if previous != ours:
            signal.set_wakeup_fd(previous)
        return previous == ours

    def read(self) -> None:
        watched = {int(signal.SIGTERM), int(signal.SIGINT)}
        while True:
            try:
                data = self.reader.recv(64)
            except OSError:
                return
            now = time.monotonic()
            for signum in data:
                if signum in watched and self.current is not None:
                    self.current.arrived(signum, now)


WATCHER: SignalWatcher | None = None  # one per process, started by its first Preemption


def watch(preemption: Preemption) -> None:
    """Hand each signal's arrival to `preemption` from now on (it installs its handlers next)."""
    global WATCHER
    if WATCHER is None:
        try:
            WATCHER = SignalWatcher()
        except (ValueError, OSError):  # not the main thread, or no sockets: the handler judges repeats itself
            return
    WATCHER.current = preemption
