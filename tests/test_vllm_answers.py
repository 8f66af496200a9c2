"""What a vLLM server answers (rl.sampler: vllm) is checked where it enters (toolkit/rollout/client.py), before
anything reads it: a token id outside the policy's vocabulary, log-probabilities that are not one per token, or
more tokens than were asked for end the run in one line naming the server and what was wrong. The servers here
are small HTTP servers written in this file (a thread of the test), answering as a vLLM server that serves
another model, or a broken one, would: no vLLM needed."""

import http.server
import json
import threading

import pytest

from families import build_family
from helpers import run_toolkit, user_error_line, write_jsonl, write_recipe


class Answers(http.server.BaseHTTPRequestHandler):
    """vLLM's OpenAI-compatible routes, each completion answered with `server.completion` (token ids and
    log-probabilities as vLLM writes them with return_tokens_as_token_ids), /tokenize with `server.tokenizer`'s
    ids of the text (the tokenizer check passes)."""

    def do_GET(self):
        self.answer(getattr(self.server, "models", {"data": [{"id": "served"}]}) if self.path == "/v1/models" else {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/tokenize":
            if hasattr(self.server, "tokens"):
                return self.answer(self.server.tokens)
            tokens = self.server.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
            return self.answer({"tokens": tokens})
        if self.path == "/v1/completions":
            ids, logps = self.server.completion
            return self.answer({"choices": [{"text": "", "finish_reason": "length", "stop_reason": None,
                                             "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                                          "token_logprobs": logps}}]})
        self.answer({})  # loading and unloading an adapter

    def answer(self, value):
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """A server answering every completion with (ids, log-probabilities) as given: its URL."""
    started = []

    def start(completion, tokenizer=None, **answers):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
        server.completion, server.tokenizer = completion, tokenizer
        for route, answer in answers.items():  # models=..., tokens=...: that route's answer as given
            setattr(server, route, answer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def test_each_completion_is_checked_where_it_enters(serve):
    from toolkit.errors import ToolkitError
    from toolkit.rollout import client

    params = {"max_tokens": 4}
    url = serve(([5, 6, 7], [-0.5, -1.0, -2.0]))
    assert client.complete(url, "m", [1, 2], 0, params, [], timeout=10, vocab=8) == ([5, 6, 7], [-0.5, -1.0, -2.0])
    cases = [
        (([5, 262, 7], [-0.5, -1.0, -2.0]), "answered a completion with token id 262, outside the policy's "
                                              "vocabulary of 262 tokens (ids 0 to 261)"),
        (([5, -1], [-0.5, -1.0]), "answered a completion with token id -1, outside the policy's vocabulary"),
        (([5, 6, 7], [-0.5, -1.0]), "answered a completion of 3 token ids with 2 log-probabilities"),
        (([5, 6, 7, 8, 9], [-0.5] * 5), "answered a completion of 5 tokens where at most 4 were asked for"),
        (([5, "x"], [-0.5, -1.0]), "answered a completion without token ids and log-probabilities"),
    ]
    for completion, expected in cases:
        url = serve(completion)
        with pytest.raises(ToolkitError) as caught:
            client.complete(url, "m", [1, 2], 0, params, [], timeout=10, vocab=262)
        line = str(caught.value)
        assert line.startswith(f"rl.sampler: the vLLM server at {url} ") and expected in line, line
        assert "\n" not in line


def test_a_server_answering_other_json_is_one_line(serve):
    """A server that answers JSON of another shape than vLLM's (a list of names for /v1/models, a mapping for
    /tokenize) is read as listing no model, and refused at the tokenizer check, not a traceback."""
    from toolkit.errors import ToolkitError
    from toolkit.model.load import build_byte_tokenizer
    from toolkit.rollout import client

    assert client.served_models(serve(None, models={"data": ["served"]}), timeout=10) == []
    assert client.served_models(serve(None, models={"data": 3}), timeout=10) == []
    for tokens in ({"tokens": {"ids": [1, 2]}}, {"tokens": 7}, ["not", "a", "mapping"]):
        url = serve(None, tokens=tokens)
        with pytest.raises(ToolkitError) as caught:
            client.check_tokenizer(url, "m", build_byte_tokenizer(), timeout=10)
        line = str(caught.value)
        assert line.startswith(f"rl.sampler: the server at {url} answered /tokenize without a list of token ids"), line


@pytest.mark.launch
def test_a_token_outside_the_vocabulary_ends_the_run_in_one_line(serve, tmp_path):
    """A server that serves the same tokenizer over a larger vocabulary (another model, or one with added rows)
    samples an id the policy has no row for: before the check, an IndexError in the correction's forward."""
    from transformers import AutoTokenizer

    model = build_family("llama3", tmp_path / "llama3")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    url = serve(([10, vocab + 3, 11], [-0.1, -0.2, -0.3]), AutoTokenizer.from_pretrained(model))
    rows = [{"prompt": [{"role": "user", "content": f"Say {i}."}]} for i in range(4)]
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"path": str(model)},
                        lora={"enabled": True, "r": 4, "alpha": 8},
                        data={"train_files": [str(write_jsonl(tmp_path / "p.jsonl", rows))], "format": "prompt",
                              "max_seq_len": 128},
                        rl={"method": "grpo", "num_generations": 2, "max_new_tokens": 4, "sampler": "vllm",
                            "vllm_url": url, "rewards": [{"function": "regex", "pattern": "e"}]},
                        train={"micro_batch_size": 2, "max_steps": 1})
    line = user_error_line(run_toolkit("train", str(path)))
    assert line.startswith(f"error: rl.sampler: the vLLM server at {url} answered a completion with token id "
                           f"{vocab + 3}, outside the policy's vocabulary of {vocab} tokens"), line
