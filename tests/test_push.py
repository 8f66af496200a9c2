"""`toolkit push MODEL_DIR USER/NAME` (toolkit/verbs/push.py): everything judged without the network is
judged first, one line each (not a folder, a checkpoint, no weights, a bad id, HF_HUB_OFFLINE, no
token); `--dry-run` lists exactly the files a push sends (hidden temporary files left out); against
a local endpoint, a closed port and a server that refuses the token each end in one line naming
the endpoint. Nothing here reaches the Hub."""

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from helpers import ROOT

pytestmark = pytest.mark.launch  # the CLI, as a user runs it


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_byte_tokenizer, build_model

    final = tmp_path_factory.mktemp("push") / "final"
    build_model(ModelConfig(preset="tiny-llama")).save_pretrained(final)
    build_byte_tokenizer().save_pretrained(final)
    (final / "README.md").write_text("---\nlibrary_name: transformers\n---\n# tiny\n")
    (final / ".model.safetensors.123.tmp").write_bytes(b"a write in progress")
    return final


def push(*args, token=None, **env):
    """The verb in a process of its own, with a Hugging Face home of its own (no stored token)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update({"HF_HOME": str(env.pop("home")), **({"HF_TOKEN": token} if token else {}), **env})
    return subprocess.run([sys.executable, "-m", "toolkit", "push", *map(str, args)], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: push: "), result.stderr
    return lines[0]


def test_dry_run_lists_what_a_push_sends(folder, tmp_path):
    result = push(folder, "someone/tiny", "--dry-run", home=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    on_disk = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert listed == on_disk and "README.md" in listed and "model.safetensors" in listed
    assert "dry run: nothing pushed (no token is set yet)" in result.stdout
    offline = push(folder, "someone/tiny", "--dry-run", token="hf_x", home=tmp_path, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0 and ("dry run: nothing pushed (a token is set; HF_HUB_OFFLINE is set, so nothing "
                                        "can reach the Hub; unset it to push)") in offline.stdout, offline.stderr


def test_what_needs_no_network_is_refused_first_in_one_line(folder, tmp_path):
    checkpoint = tmp_path / "step-000002"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    cases = [((tmp_path / "absent", "a/b"), {}, "is not a folder"),
             ((checkpoint, "a/b"), {}, "is a training checkpoint; make it a model folder first"),
             ((empty, "a/b"), {}, "holds no weights"),
             ((folder, "not an id!"), {}, "is not a Hub repository id"),
             ((folder, "tiny"), {}, "name the owner too"),
             ((folder, "a/b"), {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
             ((folder, "a/b"), {}, "no Hugging Face token: run `.venv/bin/hf auth login`, or set HF_TOKEN")]
    for args, env, expected in cases:
        assert expected in one_line(push(*args, home=tmp_path, **env)), (args, env)


class Refusing(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (the standard library's name)
        body = json.dumps({"error": "Invalid credentials in Authorization header"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST  # noqa: N815

    def log_message(self, *args):
        pass


def test_an_unreachable_or_refusing_endpoint_is_one_line_naming_it(folder, tmp_path):
    closed = push(folder, "someone/tiny", token="hf_not_a_token", home=tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert "http://127.0.0.1:9/someone/tiny" in one_line(closed)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        refused = push(folder, "someone/tiny", token="hf_not_a_token", home=tmp_path, HF_ENDPOINT=endpoint)
    finally:
        server.shutdown()
    assert "the Hub refused the token (HTTP 401)" in one_line(refused)


def test_an_endpoint_that_accepts_and_never_answers_is_one_line_after_the_timeout(folder, tmp_path):
    """Issue 69.5: an endpoint that takes the connection and never answers (a socket that listens and never reads)
    made the push wait forever. Every request has a timeout (`--timeout`, seconds without an answer): then the push
    ends in one line naming the endpoint, as the other network faults."""
    import socket
    import time

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        began = time.monotonic()
        result = push(folder, "someone/tiny", "--timeout", "2", token="hf_not_a_token", home=tmp_path,
                      HF_ENDPOINT=endpoint)
    line = one_line(result)
    assert f"{endpoint}/someone/tiny: no answer within 2 s" in line, line
    assert time.monotonic() - began < 120
    for bad in ("0", "-1", "nan", "inf"):
        assert one_line(push(folder, "someone/tiny", "--timeout", bad, token="hf_not_a_token", home=tmp_path)) == (
            f"error: push: --timeout {float(bad):g}: give the seconds a request may wait, above 0")


class Silent(http.server.BaseHTTPRequestHandler):
    asked = threading.Event()

    def do_POST(self):  # noqa: N802 (the standard library's name): a Hub that takes the request and never answers
        Silent.asked.set()
        threading.Event().wait(60)

    def log_message(self, *args):
        pass


def test_a_signal_while_the_hub_is_asked_is_one_line_exit_75(folder, tmp_path):
    import signal

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update(HF_HOME=str(tmp_path), HF_TOKEN="hf_not_a_token",
                       HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}")
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "push", str(folder), "someone/tiny"], cwd=ROOT,
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert Silent.asked.wait(120), "the push never asked the Hub"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        server.shutdown()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 75 and len(lines) == 1 and "during push" in lines[0], err
