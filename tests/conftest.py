"""Shared helpers: real launches of `python -m toolkit` / `accelerate launch`, real files on disk."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_toolkit(*args, cwd=ROOT, env=None, timeout=900, launcher=None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process (optionally under `accelerate launch ...`)."""
    cmd = (launcher or [sys.executable, "-m"]) + ["toolkit", *map(str, args)]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def load_weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def alpaca_rows(n: int, seed: int = 0) -> list[dict]:
    """Examples of deliberately unequal lengths."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 14)))
        rows.append({"instruction": "Reverse" + "!" * rng.randint(0, 6), "input": word, "output": word[::-1]})
    return rows


def write_recipe(path: Path, **sections) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


_OPS_SCRIPT = """
import os, sys
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
CPUAdamBuilder().load(verbose=False)
aio = AsyncIOBuilder()
if aio.is_compatible(verbose=False):
    aio.load(verbose=False)
    print("async_io")
"""


@pytest.fixture(scope="session")
def deepspeed_ops() -> set[str]:
    """Build DeepSpeed's just-in-time ops once, in one process, before any launch needs them.

    Two ranks reaching a first-time build together wait on a lock file; a build killed midway
    (a test timeout) leaves that lock behind and every later launch waits forever. So: clear
    locks of unfinished builds, then build here with a long timeout of its own.
    Returns the optional ops that are available ("async_io" needs Debian's libaio-dev).
    """
    from torch.utils.cpp_extension import _get_build_directory

    for name in ("cpu_adam", "async_io"):
        folder = Path(_get_build_directory(name, verbose=False))
        if (folder / "lock").exists() and not (folder / f"{name}.so").exists():
            (folder / "lock").unlink()
    proc = subprocess.run([sys.executable, "-c", _OPS_SCRIPT], capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return set(proc.stdout.split())


@pytest.fixture
def data_files(tmp_path):
    train = write_jsonl(tmp_path / "data" / "train.jsonl", alpaca_rows(64, seed=1))
    evaluation = write_jsonl(tmp_path / "data" / "eval.jsonl", alpaca_rows(12, seed=2))
    return train, evaluation


def base_recipe(tmp_path, train, evaluation, out="run", **overrides) -> dict:
    recipe = {
        "output_dir": str(tmp_path / out),
        "seed": 7,
        "model": {"preset": "tiny-llama-mini"},
        "lora": {"enabled": False},
        "data": {"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "alpaca",
                 "max_seq_len": 96},
        "train": {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 8,
                  "learning_rate": 1e-3, "warmup_steps": 2, "precision": "fp32", "log_every_steps": 4},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            recipe[section][name] = value
        else:
            recipe[section] = value
    return recipe
