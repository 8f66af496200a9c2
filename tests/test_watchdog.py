"""The hang watchdog (toolkit/observe/watchdog.py) on a fake clock: slow work that keeps moving is
never a hang, work that stops moving is reported once past its limit, and a run of one process is
never told that a collective is stuck (issue 45: a bf16 run on a CPU host, 3x slower than fp32, was
reported as "a collective, the device or the file system is stuck" on a single process). The
two-rank report of a real run is in test_observe.py."""

from toolkit.observe.watchdog import FIRST_SECONDS, FLOOR_SECONDS, Watchdog, who_is_behind


class Clocks:
    """Wall seconds and this process's CPU seconds, moved by hand."""

    def __init__(self):
        self.wall = self.cpu = 1000.0

    def tick(self, seconds: float, busy: float) -> None:
        self.wall += seconds
        self.cpu += seconds * busy  # busy: cores' worth of CPU the process used meanwhile


def watchdog(tmp_path, cpu: bool, world: int = 1, is_main: bool = True, limit=None) -> tuple[Watchdog, Clocks]:
    clocks = Clocks()
    dog = Watchdog(tmp_path, 0, world, is_main, limit, enabled=False, cpu=cpu, clock=lambda: clocks.wall,
                   cpu_clock=lambda: clocks.cpu)
    return dog, clocks


def run_for(dog: Watchdog, clocks: Clocks, seconds: float, busy: float = 0.0, phases: tuple = ()) -> None:
    """`seconds` of work, looked at every second (as the thread does); `phases` are entered in turn."""
    for i in range(int(seconds)):
        if phases:
            dog.at(phases[i % len(phases)], dog.unit[1], micro=i)
        clocks.tick(1.0, busy)
        dog.look()


def steps(dog: Watchdog, clocks: Clocks, first: int, count: int, seconds: float) -> None:
    for step in range(first, first + count):
        dog.begin("step", step)
        dog.at("forward", step)
        run_for(dog, clocks, seconds, busy=2.0)
        dog.done()


def watchdog_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("watchdog: ")]


def test_a_slow_first_step_that_computes_is_not_a_hang(tmp_path, capsys):
    """bf16 emulated on a CPU: one long forward, the process using a core throughout, for 3x the
    first step's limit. Nothing is reported, nothing written."""
    dog, clocks = watchdog(tmp_path, cpu=True)
    dog.begin("step", 1)
    dog.at("forward", 1)
    run_for(dog, clocks, 3 * FIRST_SECONDS, busy=1.0)
    dog.done()
    assert dog.fired is None and watchdog_lines(capsys) == []
    assert not (tmp_path / "hang").exists()


def test_a_step_20x_slower_than_the_recent_ones_that_computes_is_not_a_hang(tmp_path, capsys):
    """On a crowded host a computing process still gets a share of a core (a fifth, here)."""
    dog, clocks = watchdog(tmp_path, cpu=True)
    steps(dog, clocks, 1, 5, seconds=2)
    dog.begin("step", 6)
    dog.at("backward", 6)
    run_for(dog, clocks, 10 * FLOOR_SECONDS, busy=0.2)
    dog.done()
    assert dog.fired is None and watchdog_lines(capsys) == []


def test_a_step_whose_phases_advance_is_not_a_hang_on_a_gpu(tmp_path, capsys):
    """On a GPU host CPU time proves nothing (the host spins while it waits for the device); a
    new phase or micro-batch does."""
    dog, clocks = watchdog(tmp_path, cpu=False)
    steps(dog, clocks, 1, 5, seconds=2)
    dog.begin("step", 6)
    run_for(dog, clocks, 10 * FLOOR_SECONDS, busy=1.0, phases=("forward", "backward"))
    dog.done()
    assert dog.fired is None and watchdog_lines(capsys) == []


def test_one_process_that_stops_moving_is_reported_without_a_collective(tmp_path, capsys):
    """Past its limit (the 120 s floor: recent steps took 2 s) with no CPU used: reported once, the
    line naming what can hold one process and not a collective; then its end."""
    dog, clocks = watchdog(tmp_path, cpu=True)
    steps(dog, clocks, 1, 5, seconds=2)
    dog.begin("step", 6)
    dog.at("backward", 6)
    run_for(dog, clocks, FLOOR_SECONDS - 2, busy=0.01)
    assert dog.fired is None
    run_for(dog, clocks, 4, busy=0.01)
    assert dog.fired == dog.unit
    run_for(dog, clocks, 30, busy=0.01)
    dog.done()
    lines = watchdog_lines(capsys)
    assert len(lines) == 2, lines
    assert lines[0].startswith("watchdog: step 6 has run 122 s without moving (limit 120 s, recent ones 2.00 s): the "
                               "process is in the backward of micro-batch 1 of step 6 at "), lines[0]
    assert "using no CPU; with one process no collective is involved: the device, the file system or a " \
           "data-loading worker is stuck" in lines[0], lines[0]
    assert "collective, the device or the file system is stuck" not in lines[0]
    assert lines[1] == "watchdog: step 6 finished after 152 s"
    assert "running 12" in (tmp_path / "hang" / "step-6-rank0.txt").read_text()


def test_work_that_moved_then_stopped_counts_only_the_time_since(tmp_path, capsys):
    """A GPU step that advanced through its micro-batches for 200 s, then stopped: the limit runs
    from its last move, and the line says how long it has been still."""
    dog, clocks = watchdog(tmp_path, cpu=False)
    steps(dog, clocks, 1, 5, seconds=2)
    dog.begin("step", 6)
    run_for(dog, clocks, 200, phases=("forward", "backward"))
    run_for(dog, clocks, FLOOR_SECONDS - 2)
    assert dog.fired is None
    run_for(dog, clocks, 4)
    lines = watchdog_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("watchdog: step 6 has run 321 s, the last 121 s without moving "
                                                   "(limit 120 s"), lines
    assert "is stuck, or one operation there runs this long" in lines[0], lines[0]


def test_another_rank_reports_past_the_limit_even_while_it_moves(tmp_path):
    """The main process may be stuck waiting for a rank that is slow but moving: that rank still
    writes its report (marked moving), so the main process can name it rather than call it silent."""
    dog, clocks = watchdog(tmp_path, cpu=True, world=2, is_main=False)
    steps(dog, clocks, 1, 5, seconds=2)
    dog.begin("step", 6)
    dog.at("forward", 6)
    run_for(dog, clocks, FLOOR_SECONDS + 2, busy=1.0)
    assert dog.fired == dog.unit
    report = (tmp_path / "hang" / "step-6-rank0.json").read_text()
    assert '"moving": true' in report


def test_the_rank_the_others_wait_for_is_said_to_be_moving_when_it_is():
    def at(phase, step, collective=False, moving=False, frame="train.py:1 in fit"):
        return ((phase, step, "", 0), frame, collective, moving)

    line = who_is_behind({0: at("forward", 3, collective=True, frame="parallel/distributed.py:9 in _sync"),
                          1: at("forward", 3, moving=True, frame="torch/nn/functional.py:5 in linear")}, 2)
    assert line.startswith("rank 1 is in the forward of micro-batch 1 of step 3 at torch/nn/functional.py:5 in "
                           "linear (moving: slow, not stuck) while 0 is waiting in a collective"), line
    line = who_is_behind({0: at("sync", 3), 1: at("backward", 3, moving=True)}, 2)
    assert line.startswith("rank 1 is still in the backward of micro-batch 1 of step 3 (moving: slow, not stuck) "
                           "while 0 is in the reduction of the loss of step 3"), line
    assert "moving" not in who_is_behind({0: at("sync", 3), 1: at("backward", 3)}, 2)
