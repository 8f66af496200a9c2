"""`toolkit doctor`: real launches of 2 gloo processes with the shipped accelerate configs; a rank
made to send wrong values or to stop answering must turn into a FAIL line, quickly."""

import re
import socket
import sys
import time

import pytest

from helpers import ROOT, run_toolkit, user_error_line

CHECKS = ("versions", "devices", "launch", "ranks", "all-reduce (sum) on 2 ranks", "broadcast from rank 0 on 2 ranks",
          "all-gather on 2 ranks", "reduce-scatter on 2 ranks", "all-to-all on 2 ranks", "bandwidth (gloo)",
          "gradient sync (DDP, 2 ranks)")


def launcher(config: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" /
            f"{config}.yaml"), "--num_processes", "2", "--main_process_port", "0", "-m"]


def doctor(*args, config=None, env=None, timeout=180):
    start = time.monotonic()
    proc = run_toolkit("doctor", *args, launcher=launcher(config) if config else None, env=env, timeout=timeout)
    return proc, time.monotonic() - start


def verdicts(stdout: str) -> dict[str, str]:
    """{check name: the line}, from the `ok`/`FAIL` lines."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"(ok  |FAIL) (.+?)(: .*)?$", line)
        if m:
            found[m.group(2)] = line
    return found


@pytest.mark.launch
def test_two_processes_pass_and_measure_bandwidth():
    proc, _ = doctor(config="ddp")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = verdicts(proc.stdout)
    assert set(CHECKS) <= set(lines), proc.stdout
    assert all(line.startswith("ok   ") for line in lines.values()), proc.stdout
    assert "launch: DDP, 2 processes" in lines["launch"]
    assert "gloo, world size 2, 1 node(s)" in lines["ranks"]
    busbw = float(re.search(r"busbw ([0-9.]+) GB/s", lines["bandwidth (gloo)"]).group(1))
    assert busbw > 0, lines["bandwidth (gloo)"]
    assert proc.stdout.splitlines()[-1] == f"doctor: all {len(lines)} checks passed", proc.stdout


@pytest.mark.launch
def test_a_rank_sending_wrong_values_fails_naming_it():
    proc, elapsed = doctor(config="ddp", env={"TOOLKIT_FAULT_DOCTOR_WRONG_RANK": "1"})
    assert proc.returncode != 0, proc.stdout
    lines = verdicts(proc.stdout)
    assert lines["all-reduce (sum) on 2 ranks"].startswith("FAIL"), proc.stdout
    assert "rank 1 got 101 at element 0, expected 1" in lines["all-reduce (sum) on 2 ranks"], proc.stdout
    assert "in rank 1's part" in lines["all-gather on 2 ranks"], proc.stdout  # the sender, named by every rank
    assert "from rank 1" in lines["all-to-all on 2 ranks"], proc.stdout
    assert lines["broadcast from rank 0 on 2 ranks"].startswith("ok"), proc.stdout
    assert "hint: ranks exchange wrong data" in proc.stdout
    assert "3 of" in proc.stdout.splitlines()[-1] and "FAILED" in proc.stdout.splitlines()[-1], proc.stdout
    assert elapsed < 60, elapsed


@pytest.mark.launch
def test_a_rank_that_stops_answering_fails_within_the_timeout():
    proc, elapsed = doctor("--timeout", "5", config="ddp", env={"TOOLKIT_FAULT_DOCTOR_HANG_RANK": "1"})
    assert proc.returncode != 0, proc.stdout
    assert "FAIL all-reduce (sum): no answer within 5 s" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "hint: a rank stopped answering" in proc.stdout
    assert elapsed < 60, elapsed


@pytest.mark.launch
def test_a_rank_that_never_comes_fails_the_rendezvous():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    proc, elapsed = doctor("--timeout", "3", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "FAIL rendezvous: no answer within 3 s" in proc.stdout, proc.stdout
    assert "hint: every rank must reach MASTER_ADDR:MASTER_PORT" in proc.stdout
    assert elapsed < 60, elapsed


@pytest.mark.launch
def test_one_process_passes():
    proc, _ = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = verdicts(proc.stdout)
    assert all(line.startswith("ok   ") for line in lines.values()), proc.stdout
    assert "all-reduce (sum) on 1 rank" in lines and "gradient sync (DDP, 1 rank)" in lines, proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("doctor: all"), proc.stdout


@pytest.mark.launch
def test_zero2_offload_reports_cpu_adam_without_building_it(tmp_path):
    """An empty extensions folder: the op is not built, and the doctor says so instead of compiling it."""
    proc, elapsed = doctor(config="zero2_offload", env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = verdicts(proc.stdout)
    assert "DeepSpeed ZeRO-2 (offload optimizer to cpu)" in lines["launch"], proc.stdout
    assert lines["deepspeed op cpu_adam"].startswith("ok   deepspeed op cpu_adam: compatible, not built"), proc.stdout
    assert "deepspeed op async_io" not in lines  # no NVMe in this config
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.o")), "the doctor compiled an op"
    assert elapsed < 120, elapsed


def test_op_status_built_unbuilt_and_stale_lock(tmp_path, monkeypatch):
    from toolkit.verbs.doctor import needed_ops, op_status

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert needed_ops({"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}) == \
        ["cpu_adam", "async_io"]
    assert needed_ops({"stage": 2}) == []
    # a DeepSpeed JSON's Adam is DeepSpeed's FusedAdam on CUDA (built at the first launch), torch's AdamW elsewhere
    assert needed_ops({"stage": 2}, {"type": "AdamW"}, cuda=True) == ["fused_adam"]
    assert needed_ops({"stage": 2}, {"type": "AdamW"}, cuda=False) == []
    assert needed_ops({"offload_optimizer": {"device": "cpu"}}, {"type": "AdamW"}, cuda=True) == ["cpu_adam"]
    ok, text, _ = op_status("cpu_adam")
    assert ok and text.startswith("compatible, not built"), text
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    ok, text, hint = op_status("cpu_adam")
    assert not ok and "unfinished build" in text and "remove the lock file" in hint, text
    (tmp_path / "cpu_adam" / "cpu_adam.so").touch()
    ok, text, _ = op_status("cpu_adam")
    assert ok and text == f"compatible, built ({tmp_path / 'cpu_adam'})", text


@pytest.mark.launch
def test_bad_arguments_are_one_error_line():
    proc, _ = doctor("--timeout", "0")
    assert "--timeout and --size-mb must be positive" in user_error_line(proc)
