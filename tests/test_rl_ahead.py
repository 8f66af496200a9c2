"""rl_ahead.Ahead, the schedule of rl.max_staleness without a server (the launched runs against a real vLLM server
are tests/test_staleness.py): which step's batch is sampled after which weights, that the server's weights change
only with no batch in flight, what a checkpoint holds and what a resume takes, and the one-line refusals."""

import pickle
import threading
import time

import pytest
import torch
from accelerate import Accelerator

from toolkit.errors import ToolkitError
from toolkit.training.rl_ahead import Ahead, keys_of


def batch(step: int) -> list[dict]:
    """A step's micro-batches as the loader gives them: two prompts whose rows are the step's."""
    return [{"keys": torch.tensor([[0, 2 * step], [0, 2 * step + 1]])}]


class Server:
    """What the run's sampling does, recorded: `weights` is the optimizer steps done when they went in; each
    batch is 'sampled' with the weights in the server while it runs, slowly, in the thread."""

    def __init__(self):
        self.weights, self.sampled, self.in_flight = -1, {}, 0
        self.lock = threading.Lock()

    def sync(self, done: int):
        assert self.in_flight == 0, "weights changed while a batch was being sampled"
        self.weights = done

    def sampling(self, step: int, micro_batches):
        def work():
            with self.lock:
                self.in_flight += 1
            time.sleep(0.01)
            self.sampled[step] = self.weights
            with self.lock:
                self.in_flight -= 1
            return f"batch {step}"
        return work


def run(ahead: Ahead, server: Server, steps: range, total: int) -> list[tuple[int, object, int]]:
    out = []
    for step in steps:
        later = [batch(step + j) for j in range(1, min(ahead.staleness, total - step) + 1)]
        made, lag = ahead.step(step, keys_of(batch(step)), later, lambda s=step: server.sync(s - 1), server.sampling)
        out.append((step, made, lag))
    return out


@pytest.mark.parametrize("staleness", [1, 2])
def test_each_batch_is_sampled_with_the_weights_of_its_lag(staleness):
    server, ahead = Server(), Ahead(staleness, Accelerator(cpu=True))
    try:
        got = run(ahead, server, range(1, 7), 6)
    finally:
        ahead.close()
    assert [(step, made) for step, made, _ in got] == [(k, f"batch {k}") for k in range(1, 7)]
    assert [lag for *_, lag in got] == [min(staleness, k - 1) for k in range(1, 7)]
    assert server.sampled == {k: max(k - 1 - staleness, 0) for k in range(1, 7)}
    assert ahead.pending == {}  # nothing sampled past the run's last step


def test_a_checkpoint_holds_the_batches_in_flight_and_a_resume_takes_them(tmp_path):
    server, ahead = Server(), Ahead(1, Accelerator(cpu=True))
    whole = run(ahead, server, range(1, 6), 5)
    ahead.close()
    server, first = Server(), Ahead(1, Accelerator(cpu=True))
    part = run(first, server, range(1, 3), 5)
    first.save(tmp_path)  # after step 2: step 3's batch, sampled with the weights after step 1
    first.close()
    resumed = Ahead(1, Accelerator(cpu=True))
    resumed.load(tmp_path)
    assert list(resumed.pending) == [3]
    rest = run(resumed, Server(), range(3, 6), 5)
    resumed.close()
    assert part + rest == whole


def test_a_resume_refuses_other_data_or_another_process_count(tmp_path):
    first = Ahead(1, Accelerator(cpu=True))
    run(first, Server(), range(1, 2), 5)
    first.save(tmp_path)
    first.close()
    resumed = Ahead(1, Accelerator(cpu=True))
    resumed.load(tmp_path)
    with pytest.raises(ToolkitError, match="resume: the batch of step 2 sampled ahead is not of the prompts"):
        resumed.step(2, keys_of(batch(7)), [], lambda: None, Server().sampling)
    saved = pickle.loads((tmp_path / "ahead_rank0.pkl").read_bytes())
    (tmp_path / "ahead_rank0.pkl").write_bytes(pickle.dumps({**saved, "processes": 2}))  # as 2 ranks save it
    with pytest.raises(ToolkitError, match=r"holds the batches sampled ahead \(rl.max_staleness\) on 2 processes"):
        Ahead(1, Accelerator(cpu=True)).load(tmp_path)


def test_a_failure_while_sampling_ahead_ends_the_step_that_takes_it_in_one_line():
    ahead = Ahead(1, Accelerator(cpu=True))

    def sampling(step, micro_batches):
        def work():
            if step == 2:
                raise ToolkitError("rl.vllm_url: the server at http://127.0.0.1:9 went away")
            return step
        return work
    try:
        assert ahead.step(1, keys_of(batch(1)), [batch(2)], lambda: None, sampling) == (1, 0)
        with pytest.raises(ToolkitError, match="^rl.vllm_url: the server at http://127.0.0.1:9 went away$"):
            ahead.step(2, keys_of(batch(2)), [batch(3)], lambda: None, sampling)
    finally:
        ahead.close()
