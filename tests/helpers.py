"""Test helpers: real launches of `python -m toolkit` / `accelerate launch`, real files on disk,
recipes of the shared reference runs. Imported by the test modules; the fixtures that use them
live in conftest.py."""

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads that wait for work sleep instead of spinning: the suite runs several processes on 2
# cores at once (2 xdist workers, some tests run cases side by side), and spinning threads took the
# cores their peers needed (3 one-process runs at once: 17 s spinning, 9 s sleeping; one alone: the
# same 5.7 s either way). The thread count, and so every result, is unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_toolkit(*args, cwd=ROOT, env=None, timeout=900, launcher=None) -> subprocess.CompletedProcess:
    """Run the CLI in a fresh process (optionally under `accelerate launch ...`)."""
    cmd = (launcher or [sys.executable, "-m"]) + ["toolkit", *map(str, args)]
    return run_command(cmd, cwd=cwd, env=env, timeout=timeout)


def run_command(cmd, cwd=ROOT, env=None, timeout=900) -> subprocess.CompletedProcess:
    """subprocess.run in a process group of its own, killed with all its descendants however the
    test ends (a timeout, a failed assertion, pytest-timeout): a launch leaves no workers behind."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _STARTED.append(proc)
    LAUNCHES[0] += 1
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def shared_base(tmp_path_factory) -> Path:
    """The folder every pytest-xdist worker of this session sees (the controller's base temp, whose
    `gw0`, `gw1` folders are the workers' own); without xdist, this session's base temp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(marker: Path, make) -> None:
    """Call `make()` in one process of the session: the other xdist workers wait on its lock and
    skip it once `marker` says it succeeded (a failed `make` leaves no marker: the next caller tries again)."""
    with FileLock(f"{marker}.lock"):
        if not marker.exists():
            make()
            marker.touch()


_STARTED: list[subprocess.Popen] = []
LAUNCHES = [0]  # processes the helpers have started in this session (conftest checks the `launch` mark with it)


def kill_started() -> None:
    """End every process group a helper started (conftest calls this after each test)."""
    while _STARTED:
        kill_group(_STARTED.pop())


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and every process descended from it, then reap it.
    torchrun starts each worker in a process group of its own, so the group alone is not enough:
    the descendants are found (from /proc) before anything is killed, while they are still linked."""
    doomed = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start(cmd, env=None) -> subprocess.Popen:
    """Start a run in the background (its own session), its output going to files, not pipes: a run
    nobody reads from while it trains would block once a pipe's 64 KiB are full (ZeRO-3 warns on
    every collective). `finish` waits and returns (returncode, stdout, stderr)."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, stderr=err, text=True,
                            start_new_session=True)
    proc.output = (out, err)
    _STARTED.append(proc)
    LAUNCHES[0] += 1
    return proc


def read_output(proc) -> tuple[str, str]:
    texts = []
    for f in proc.output:
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def finish(proc, timeout=900):
    proc.wait(timeout=timeout)
    return (proc.returncode, *read_output(proc))


LAUNCHER_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


def user_error_line(proc, launched: bool = False, code: int = 2) -> str:
    """The one `error: ...` line of a refused run, checked: exit `code`, no traceback from the
    toolkit's processes. Under `accelerate launch` the launcher process itself (not the toolkit)
    ends with its report of a failed worker, a ChildFailedError traceback, and exits 1; that report
    must name `code` as the root cause's exit code and is the only traceback allowed."""
    ours, report = proc.stderr, ""
    if launched:
        assert proc.returncode == 1, proc.stderr[-3000:]
        end = proc.stderr.index(LAUNCHER_FAILURE)
        start = proc.stderr.rindex("Traceback (most recent call last):", 0, end)
        ours, report = proc.stderr[:start], proc.stderr[start:]
        assert "Root Cause" in report and f"exitcode  : {code} " in report.split("Root Cause", 1)[1], report[-2000:]
    else:
        assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in ours, ours[-3000:]
    errors = [line for line in ours.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, ours[-3000:]
    if not launched:
        assert [line for line in ours.splitlines() if line.strip()][-1] == errors[0], ours[-3000:]
    return errors[0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reached_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 600) -> bool:
    """Wait until a run started with `start` has logged `step` in its metrics.jsonl (True), or ended or
    `timeout` passed (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if max(r["step"] for r in read_metrics(run_dir)) >= step:
                return True
        except (FileNotFoundError, ValueError, json.JSONDecodeError):
            pass
        time.sleep(0.05)
    return False


def kill_after_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 600) -> None:
    """SIGKILL a run started with `start` (it and every process it started) once its metrics.jsonl has
    logged `step`, or once it ended or `timeout` passed; reaped."""
    reached_step(proc, run_dir, step, timeout)
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    finish(proc)


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


def alpaca_folder(d: Path) -> Path:
    """`d` with a small Alpaca train (32 rows) and eval (4 rows) file, as the short runs of the
    run-folder, config, data and adapter-base tests train on."""
    write_jsonl(d / "train.jsonl", alpaca_rows(32, seed=41))
    write_jsonl(d / "eval.jsonl", alpaca_rows(4, seed=42))
    return d


def short_recipe(work: Path, name: str, **overrides) -> Path:
    """A 3-step recipe over `alpaca_folder(work)`'s files, training into `work/name`."""
    r = base_recipe(work, work / "train.jsonl", work / "eval.jsonl", out=name, train__max_steps=3,
                    train__warmup_steps=1, **overrides)
    return write_recipe(work / f"{name}.yaml", **r)


def write_recipe(path: Path, **sections) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


# DeepSpeed's just-in-time ops are built into a folder of this checkout (not ~/.cache), so a
# fresh clone never meets a lock or a half-built op left there by another run; every launch the
# tests start inherits the setting.
EXTENSIONS = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")))
# Built without debug information (tests/ops/c++ says why); torch's ninja build calls $CXX.
if Path("/usr/bin/c++").is_file() or "TOOLKIT_REAL_CXX" in os.environ:
    os.environ.setdefault("CXX", str(ROOT / "tests" / "ops" / "c++"))


OP_SCRIPT = """
import os, sys, time
os.environ["DS_ACCELERATOR"] = "cpu"
from deepspeed.ops import op_builder
builder = getattr(op_builder, sys.argv[1])()
if not builder.is_compatible(verbose=True):
    print("INCOMPATIBLE", flush=True)
    sys.exit(0)
start = time.time()
builder.load(verbose=True)
print(f"BUILT in {time.time() - start:.0f} s", flush=True)
"""


# In the order a session first needs them: every DeepSpeed launch on a CPU host builds the shared-memory
# collective op (deepspeed.comm), an offloaded optimizer CPU Adam, the backend matrix's NVMe case async_io
# (a fresh-clone CI waited 114 s for it when it came last), the corpus's pinned-memory offload pin_memory,
# a DeepSpeed JSON's own optimizer without offload fused_adam (a test built it inside its launch: 34 s).
# A launch that meets an op still being built waits on its lock.
OPS = {"shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder",
       "pin_memory": "PinMemoryBuilder", "fused_adam": "FusedAdamBuilder"}
# Each op's own limit: async_io (12 sources) took 600 s beside the two test workers in a fresh-clone CI run on
# 2 cores (2026-11-27, linked at the limit and reported as timed out); a hung build still ends.
OP_TIMEOUT = 1500
BUILD_ALL = """
import subprocess, sys
from pathlib import Path
extensions, timeout, script = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for builder in sys.argv[4:]:
    with (extensions / f"{builder}.log").open("w") as log:
        try:
            code = subprocess.run([sys.executable, "-c", script, builder], stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = f"timed out after {timeout} s"
    (extensions / f"{builder}.exit").write_text(str(code))
"""


def train_ok(work: Path, name: str, sections: dict, *overrides, env=None) -> subprocess.CompletedProcess:
    """`toolkit train` on `sections` written to `work/name.yaml`; the run must succeed."""
    proc = run_toolkit("train", write_recipe(work / f"{name}.yaml", **sections), *overrides, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start_op_builds(ops=tuple(OPS)) -> subprocess.Popen:
    """Build DeepSpeed's ops one after the other, each under a timeout of its own, in a background
    process of its own (conftest starts it when the session will need them, so the build runs
    beside the unit tier instead of before the first launch). Two ranks reaching a first-time build
    together wait on a lock file, and a build killed midway leaves that lock behind, on which every
    later launch would wait forever: locks of unfinished builds are cleared first. Each op logs to
    EXTENSIONS/<builder>.log and ends with EXTENSIONS/<builder>.exit. `ops`: the ones the session's tests
    need (async_io only for the NVMe cases: beside the test workers its build ran past 1,500 s in CI)."""
    EXTENSIONS.mkdir(parents=True, exist_ok=True)
    for lock in EXTENSIONS.glob("*/lock"):
        if not list(lock.parent.glob("*.so")):
            lock.unlink()
    for builder in OPS.values():
        (EXTENSIONS / f"{builder}.exit").unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, "-c", BUILD_ALL, str(EXTENSIONS), str(OP_TIMEOUT), OP_SCRIPT,
                             *(OPS[op] for op in ops)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class BuildsElsewhere:
    """The op builds another pytest-xdist worker of this session started: `poll()` as a Popen's."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return 0
        return None


def session_op_builds(shared: Path, ops=tuple(OPS)):
    """`start_op_builds` once per session: the first xdist worker that needs the ops starts them and
    writes the builder's pid to SHARED/op-builds.pid; the others wait on the same exit files. Only the
    session's main process stops them at its end (`stop_op_builds`), so a worker that finishes first
    never kills a build another worker still waits on."""
    pid_file = shared / "op-builds.pid"
    with FileLock(f"{pid_file}.lock"):
        if pid_file.exists():
            return BuildsElsewhere(int(pid_file.read_text()))
        builds = start_op_builds(ops)
        pid_file.write_text(str(builds.pid))
        return builds


def stop_op_builds(shared: Path) -> None:
    """Kill the session's op builds if still running, and clear the lock files of the builds that
    did not finish: a build killed midway leaves its lock, and when an older build's .so is beside it
    (a rebuild), `start_op_builds` of the next session cannot tell it from a live build's, so every
    later DeepSpeed launch would wait on it forever (seen: a short unit-tier session, then ZeRO-3)."""
    pid_file = shared / "op-builds.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            return
        if not all((EXTENSIONS / f"{builder}.exit").exists() for builder in OPS.values()):
            for lock in EXTENSIONS.glob("*/lock"):  # the session's processes are done: no build is live
                lock.unlink(missing_ok=True)


class OpResults(dict):
    """{op: ("built" | "incompatible" | "failed", log tail)} of `start_op_builds`, each op waited for
    only when asked for (the build of the others may still be running)."""

    def __init__(self, builds: subprocess.Popen):
        super().__init__()
        self.builds = builds

    def __missing__(self, op: str) -> tuple[str, str]:
        builder = OPS[op]
        log, exit_file = EXTENSIONS / f"{builder}.log", EXTENSIONS / f"{builder}.exit"
        deadline = time.monotonic() + OP_TIMEOUT * len(OPS) + 60
        while not exit_file.is_file() and self.builds.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log.read_text() if log.is_file() else ""
        code = exit_file.read_text() if exit_file.is_file() else "none (the build process ended first, or hung)"
        tail = f"{log}:\n" + text[-3000:]
        if code == "0":
            self[op] = ("incompatible" if "INCOMPATIBLE" in text else "built", tail)
        else:
            self[op] = ("failed", f"exit {code}; {tail}")
        return self[op]


def op_results(builds: subprocess.Popen) -> OpResults:
    return OpResults(builds)


def require_op(ops: dict, name: str) -> None:
    """Fail (with the build log) when an op that can be built here did not build; skip only
    when this host cannot build it at all."""
    status, tail = ops[name]
    if status == "incompatible":
        pytest.skip(f"DeepSpeed {name} cannot be built on this host (for async_io: Debian's libaio-dev)")
    assert status == "built", f"DeepSpeed {name} did not build: {tail}"


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
    return with_overrides(recipe, overrides)


def with_overrides(sections: dict, overrides: dict) -> dict:
    """`sections` with `overrides` set: section__key=value, or section=value (a whole section)."""
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            sections[section][name] = value
        else:
            sections[section] = value
    return sections


# The backend matrix's data and single-process references, shared by every module that compares
# against them (backends, precision, GPU): one reference run per configuration per session.
MODES = {"full": {"enabled": False},
         "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": "all-linear"}}


STEPS = 8


def recipe_for(workdir, mode, out, micro):
    return {
        "output_dir": str(workdir / out), "seed": 11,
        "model": {"preset": "tiny-llama-mini"},
        "lora": MODES[mode],
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "alpaca", "max_seq_len": 96},
        "train": {"micro_batch_size": micro, "gradient_accumulation_steps": 2, "max_steps": STEPS,
                  "learning_rate": 3e-3, "warmup_steps": 2, "precision": "fp32", "eval_every_steps": 4},
    }


def accelerate_launch(config, num_processes=2):
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
            "--num_processes", str(num_processes), "--main_process_port", "0", "-m"]


def launch_config_for(backend, workdir):
    """The shipped accelerate YAML; for ZeRO-3 a copy whose JSON partitions even tiny tensors
    (persistence threshold 0), so a save that forgot to gather would be caught."""
    src = ROOT / "accelerate_configs" / f"{backend}.yaml"
    text = src.read_text()
    if "deepspeed_config_file" not in text:
        return src
    launch = yaml.safe_load(text)
    ds_path = ROOT / launch["deepspeed_config"]["deepspeed_config_file"]
    ds = json.loads(ds_path.read_text())
    zero = ds["zero_optimization"]
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    for part in ("offload_optimizer", "offload_param"):
        if zero.get(part, {}).get("device") == "nvme":
            nvme = workdir / f"nvme_{backend}"
            nvme.mkdir(exist_ok=True)
            zero[part]["nvme_path"] = str(nvme)
    (workdir / f"{backend}.json").write_text(json.dumps(ds))
    launch["deepspeed_config"]["deepspeed_config_file"] = str(workdir / f"{backend}.json")
    (workdir / f"{backend}.yaml").write_text(yaml.safe_dump(launch))
    return workdir / f"{backend}.yaml"


# ----------------------------------------------------------------------------- runs of one recipe under each layout
# The recipe of the resume tests (tests/test_resume.py, tests/test_portable_resume.py): 8 steps of global
# batch 8 (micro 4 on one process or on one sequence-parallel pair, micro 2 x 2 processes; accumulation 2), 48 rows,
# so 6 steps per epoch and a resumed run crosses an epoch; checkpoints every 2 steps, all kept. Its uninterrupted runs
# are shared by both modules (conftest's `layout_runs`).
RESUME_STEPS = 8
LAYOUTS = {"single": None, "ddp": "ddp", "fsdp": "fsdp", "zero2": "zero2", "zero3": "zero3",
           "sp": "zero2_sp"}  # sp: ZeRO-2, each sequence split across the 2 processes (one data-parallel rank)


def write_layout_data(workdir: Path) -> Path:
    write_jsonl(workdir / "train.jsonl", alpaca_rows(48, seed=5))
    write_jsonl(workdir / "eval.jsonl", alpaca_rows(6, seed=6))
    return workdir


def layout_recipe(workdir: Path, name: str, layout: str, lora: bool = False, dropout: float = 0.0, **extra) -> Path:
    """`extra`: section__key=value overrides (train__max_steps=2, data__packing=True)."""
    sections = {
        "output_dir": str(workdir / name), "seed": 3, "model": {"preset": "tiny-llama-mini"},
        "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": dropout} if lora else {"enabled": False},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "alpaca", "max_seq_len": 96},
        "train": {"micro_batch_size": 4 if layout in ("single", "sp") else 2, "gradient_accumulation_steps": 2,
                  "max_steps": RESUME_STEPS, "learning_rate": 3e-3, "warmup_steps": 2, "eval_every_steps": 3,
                  "log_every_steps": 1},
        "checkpoint": {"every_steps": 2, "keep_last": 10},
    }
    return write_recipe(workdir / f"{name}.yaml", **with_overrides(sections, extra))


def layout_command(workdir: Path, layout: str, path: Path, *overrides) -> list[str]:
    backend = LAYOUTS[layout]
    if backend is None:
        return [sys.executable, "-m", "toolkit", "train", str(path), *overrides]
    return accelerate_launch(launch_config_for(backend, workdir)) + ["toolkit", "train", str(path), *overrides]


class References(dict):
    """references[mode]: the single-process fp32 run of helpers.recipe_for, trained the first time a
    test asks for that mode (the precision tests and the multi-node rehearsals ask for "full"), once
    for all the xdist workers of the session."""

    def __init__(self, matrix_dir: Path):
        super().__init__()
        self.matrix_dir = matrix_dir

    def __missing__(self, mode: str) -> Path:
        assert mode in MODES, mode

        def train():
            path = write_recipe(self.matrix_dir / f"ref_{mode}.yaml",
                                **recipe_for(self.matrix_dir, mode, f"ref_{mode}", micro=4))
            proc = run_toolkit("train", path)
            assert proc.returncode == 0, proc.stderr[-3000:]

        once(self.matrix_dir / f"ref_{mode}.done", train)
        self[mode] = self.matrix_dir / f"ref_{mode}"
        return self[mode]
