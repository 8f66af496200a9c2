"""A vLLM server for online RL's completions (rl.sampler: vllm): started by the run from its own
environment (`make vllm`: vLLM needs another transformers than ours) on a loopback port, its output
in `vllm.log` in the run folder, and stopped when the run ends, however it ends.

It runs in a session of its own, so the terminal's Ctrl-C reaches the run, not the server, and
`stop` ends the server and every process it started (vLLM's engine) as one group: SIGTERM, then
SIGKILL after a grace period. The kernel sends it SIGTERM if the run dies without stopping it
(PR_SET_PDEATHSIG), and an abrupt exit of the run ends its descendants (`stops.py`): nothing is left
running. `wait_ready` polls /health until it answers, and names the log's last line if the server
exits first."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from ..config.objectives import server_flag
from ..errors import ToolkitError
from . import client

GRACE_S = 20.0  # SIGTERM to SIGKILL when stopping
WORKER_PATH = Path(__file__).resolve().parent / "worker"  # full fine-tuning's extension of vLLM's workers
WORKER_EXTENSION = "toolkit_vllm_worker.WeightReload"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM 0.32's --max-lora-rank takes


EXCEPTION_LINE = re.compile(r"(?:[\w.]+\.)?\w*(Error|Exception|Interrupt)\b(:|$)")
# vLLM's prefix of each line it logs (every line of a logged traceback too), e.g.
# "(EngineCore_DP0 pid=93) ERROR 12-05 14:00:00 [v1/engine/core.py:710] ": left off before a line is read.
LOG_PREFIX = re.compile(r"^.*?\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] ")
# vLLM's words that send a reader to the stack trace "above" it printed: "See stack trace (above) for the root
# cause." (a dead engine), "See root cause above." (a failed start), "please check the stack trace above for the
# root cause" (a failed worker call). Above, in the server's own output: where the run started it, vllm.log.
DEFERS = re.compile(r",?\s*(?:please\s+)?(?:see|check)\s+(?:the\s+)?(?:root cause|stack trace)\s*(?:\(above\)|above)"
                    r"(?:\s+for\s+the\s+root\s+cause)?\.?", re.IGNORECASE)


def max_lora_rank(r: int) -> int:
    """The smallest --max-lora-rank vLLM takes that holds an adapter of rank r."""
    return next(k for k in LORA_RANKS if k >= r)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                found.append(int(entry.name))
    return found


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the run's process ends
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def explain(line: str, server: "Server | None", from_log: bool = False) -> str:
    """A failed request's line (rollout/client.py's) with the server's own words on why. Where the server the run
    started has died: its exit and the cause in its log. Where it answered with vLLM's "see stack trace (above)"
    (its engine failed while the server stays up) or failed to reload the weights: vLLM's pointer replaced by the
    cause found in vllm.log, and the log named (`from_log`: the cause in any case). A server at rl.vllm_url keeps
    its output to itself: the line says the cause is there."""
    if server is not None and not server.alive():
        return (f"rl.sampler: the vLLM server the run started exited (code {server.process.returncode}): "
                f"{server.last_line()} (log: {server.log_path})")
    defers = DEFERS.search(line) is not None
    if defers:
        line = DEFERS.sub("", line).rstrip().removesuffix(".")
    if server is not None and (defers or from_log):
        cause = server.cause()
        return line + (f"; its log {server.log_path} says: {cause}" if cause else
                       f"; its log: {server.log_path}")
    if defers:
        return line + "; the cause is in that server's own output (where vLLM printed its stack trace)"
    return line


class Server:
    """A vLLM OpenAI-compatible server this process started."""

    def __init__(self, python: Path, model: str, log_path: Path, *, max_model_len: int, dtype: str, seed: int,
                 lora_rank: int | None, args: list[str] | None = None):
        if not Path(python).is_file():
            raise ToolkitError(f"rl.vllm_python: {python} not found: run `make vllm`, or give rl.vllm_url")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--max-model-len", str(max_model_len), "--dtype", dtype,
                   "--seed", str(seed), "--logprobs-mode", "processed_logprobs"]
        if lora_rank is not None:  # the adapter is loaded at runtime
            command += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_rank)), "--max-loras", "1"]
        else:  # full fine-tuning: the weights are reloaded through our worker extension (worker/)
            command += ["--worker-extension-cls", WORKER_EXTENSION]
        command += list(args or [])
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        if "--kv-cache-memory-bytes" not in {server_flag(a) for a in args or []}:  # which the variable overrides
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU host (vLLM's default is 4)
        for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # our environment's paths would shadow the server's packages
            env.pop(key, None)
        if lora_rank is None:  # /collective_rpc, and the extension's folder (nothing else of ours)
            env.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=str(WORKER_PATH))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "ab")
        self.log.write(f"$ {' '.join(command)}\n".encode())
        self.log.flush()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True, preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        self.log.write(f"# server pid {self.process.pid} (its own process group) at {self.url}\n".encode())
        self.log.flush()

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers; the server exiting first, answering with an error (its engine failed) or `timeout`
        seconds passing end the run in one line."""
        deadline = self.started + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise ToolkitError(f"rl.sampler: the vLLM server exited with code {code} while starting: "
                                   f"{self.last_line()} (whole log: {self.log_path})")
            try:
                client.call(self.url, "/health", timeout=2.0)
                return
            except ToolkitError as err:  # vLLM listens only once its engine is up: an error status means it failed
                if " answered /health with " in str(err):
                    line = explain(f"{str(err).rstrip(': ')} while starting", self, from_log=True)
                    self.stop()
                    raise ToolkitError(line) from None
            if time.monotonic() > deadline:
                self.stop()
                cause = self.cause()
                raise ToolkitError(f"rl.vllm_timeout: the vLLM server did not answer /health within {timeout:g} s "
                                   f"of starting; its log: {self.log_path}" + (f" (its last error: {cause})"
                                                                               if cause else ""))
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_lines(self) -> list[str] | None:
        """The log's lines that say something, vLLM's prefix left off; None where it cannot be read."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        return [LOG_PREFIX.sub("", line).strip() for line in text.splitlines() if LOG_PREFIX.sub("", line).strip()]

    def cause(self) -> str | None:
        """The log's last exception line ("ValueError: ...", "torch.OutOfMemoryError: ..."), its start: not a
        traceback's frame, a warning that names an error, nor vLLM's "see the root cause above" after it."""
        for line in reversed(self.log_lines() or []):
            if EXCEPTION_LINE.match(line) and not DEFERS.search(line):
                return line[:300]
        return None

    def last_line(self) -> str:
        """The cause (`cause`), else the log's last line that says something, its start."""
        lines = self.log_lines()
        if lines is None:
            return "(no log)"
        said = [line for line in lines if not DEFERS.search(line)]
        return self.cause() or (said[-1][:300] if said else lines[-1][:300] if lines else "(empty log)")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after GRACE_S; waits for the server itself."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
            except ProcessLookupError:
                pass
        try:  # the engine's processes, in the server's group, if any outlived it (vLLM's resource tracker does)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 10
        while group_members(self.process.pid) and time.monotonic() < deadline:  # until they are gone
            time.sleep(0.05)
        if not self.log.closed:
            self.log.close()

