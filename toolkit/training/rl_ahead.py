"""rl.max_staleness: online RL's batches sampled ahead on the vLLM server, in a thread of their own, while the steps
before them train (TRL's AsyncGRPOTrainer overlap, at a fixed lag so a run is reproducible).

With staleness s, the batch of step k is sampled with the weights after step max(k - 1 - s, 0): at the start of step
k every batch in flight is waited for (the server's weights change next), the weights after step k - 1 go into the
server, and the batch of step k + s starts sampling; the first step starts steps 1 to 1 + s. Sampling in the thread
makes no collective (the ranks agree on a failure when its batch is taken, on the main thread); scoring, advantages
and the loss's log-probabilities stay on the main thread, at the step that trains the batch, so the correction
compares the sampler's log-probabilities with the weights that train (the lag included).

A checkpoint holds the batches sampled ahead (`ahead_rank<R>.pkl`, each rank its own): they were sampled with
weights the checkpoint no longer has, so a resumed run takes them as saved rather than sampling them again, and
resumes to exactly the run it would have been. It resumes on the number of processes that saved it."""

from __future__ import annotations

import pickle
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ToolkitError


@dataclass
class Pending:
    keys: list  # the (source, row) of the batch's prompts on this rank: checked when it is taken
    after: int  # the optimizer steps done when its weights went into the server
    future: Future


class Ahead:
    """The batches in flight (step -> Pending), sampled one after another by one thread."""

    def __init__(self, staleness: int, accelerator):
        self.staleness, self.accelerator = staleness, accelerator
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self.pending: dict[int, Pending] = {}

    def describe(self) -> str:
        return (f"rl: sampling ahead (rl.max_staleness {self.staleness}): the batch of step k is sampled with the "
                f"weights after step k - {1 + self.staleness} while the steps before it train; the correction "
                "covers the lag")

    def step(self, step: int, keys: list, later: list, sync: Callable[[], None],
             sampling: Callable[[int, object], Callable]) -> tuple[object, int]:
        """This step's sampled batch and its staleness. `later`: the next steps' micro-batches (fewer near the run's
        end); `sync()` puts the weights as they stand into the server; `sampling(step, micro_batches)` is the work
        that samples that step's batch (`micro_batches` None: this step's)."""
        first = step not in self.pending  # a run's first step: nothing sampled ahead yet
        wait([p.future for p in self.pending.values()])  # the server's weights change next
        sync()
        if first:
            self.launch(step, keys, step - 1, sampling(step, None))
        for j in range(1, self.staleness + 1) if first else [self.staleness]:
            if j <= len(later):
                self.launch(step + j, keys_of(later[j - 1]), step - 1, sampling(step + j, later[j - 1]))
        return self.take(step, keys)

    def launch(self, step: int, keys: list, after: int, work: Callable) -> None:
        self.pending[step] = Pending(keys, after, self.pool.submit(work))

    def take(self, step: int, keys: list) -> tuple[object, int]:
        pending = self.pending.pop(step)
        problem = failure(step, pending.future)
        if problem is None and pending.keys != keys:
            problem = (f"resume: the batch of step {step} sampled ahead is not of the prompts the data gives that "
                       "step (the data or its order changed since the checkpoint); resume with the data it was "
                       "saved with, or start a new run")
        if self.accelerator.num_processes > 1:  # every rank stops on one rank's failure
            from accelerate.utils import gather_object

            problem = next((p for p in gather_object([problem]) if p), None)
        if problem:
            raise ToolkitError(problem)
        return pending.future.result(), step - 1 - pending.after

    def save(self, folder: Path) -> None:
        """The batches in flight, each rank's own, into a checkpoint being written (waited for first)."""
        wait([p.future for p in self.pending.values()])
        saved = {step: (p.keys, p.after, ToolkitError(failure(step, p.future)) if p.future.exception() else
                        p.future.result()) for step, p in self.pending.items()}
        with open(folder / f"ahead_rank{self.accelerator.process_index}.pkl", "wb") as f:
            pickle.dump({"processes": self.accelerator.num_processes, "pending": saved}, f)

    def load(self, folder: Path) -> None:
        """A resumed run's batches in flight, as its checkpoint saved them (none where it had none: a checkpoint of
        a run without rl.max_staleness, whose next batches are sampled as a first step's)."""
        path = Path(folder) / f"ahead_rank{self.accelerator.process_index}.pkl"
        others = sorted(Path(folder).glob("ahead_rank*.pkl"))
        if not path.is_file() and not others:
            return
        saved = pickle.loads(path.read_bytes()) if path.is_file() else {"processes": len(others)}
        if not path.is_file() or saved["processes"] != self.accelerator.num_processes:
            raise ToolkitError(f"resume: {folder} holds the batches sampled ahead (rl.max_staleness) on "
                               f"{saved['processes']} processes, each its own; resume on {saved['processes']} "
                               f"processes (this launch has {self.accelerator.num_processes})")
        for step, (keys, after, result) in saved["pending"].items():
            future = Future()
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
            self.pending[step] = Pending(keys, after, future)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def failure(step: int, future: Future) -> str | None:
    """A batch's failed sampling in one line (None: it was sampled)."""
    error = future.exception()
    return None if error is None else str(error) if isinstance(error, ToolkitError) else \
        f"rl.max_staleness: sampling the batch of step {step} ahead failed: {error!r}"


def keys_of(micro_batches: list[dict]) -> list:
    """The (source, row) of each prompt of a step's micro-batches on this rank."""
    return [tuple(k) for b in micro_batches for k in b["keys"].tolist()]
