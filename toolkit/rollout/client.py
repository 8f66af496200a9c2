"""The HTTP side of a vLLM server (OpenAI-compatible, `vllm.entrypoints.openai.api_server`), with the
standard library only: health, the tokenizer check, loading a LoRA adapter at runtime, and completions of
token-id prompts with the sampled tokens' ids and log-probabilities.

Each completion is a request of its own with its own seed (one prompt, n=1): vLLM seeds a request's
sampler, so completion i depends on its seed and the weights, not on which completions share a batch.
The requests of a generated batch go out together (a thread each, up to `PARALLEL`) and the server
batches them. Every failure a user can meet (refused connection, a timeout, an error status such as a
prompt longer than the server's context) is one `ToolkitError` line naming the server."""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ..errors import ToolkitError

PARALLEL = 64  # requests in flight at once from one rank
PROBE = "Hello world, héllo! 12 + 30 = 42\n\tdef f(x): return x"  # the tokenizer check's text


def call(url: str, path: str, body: dict | None = None, *, timeout: float) -> dict | str:
    """GET (no body) or POST JSON; the answer's JSON (or its text); one line on any failure."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", {}).get("message", detail) if detail.startswith("{") else detail
        except (ValueError, AttributeError):
            pass
        raise ToolkitError(f"rl.sampler: the vLLM server at {url} answered {path} with {err.code}: "
                           f"{' '.join(str(detail).split())[:300]}") from None
    except TimeoutError:
        raise ToolkitError(f"rl.vllm_timeout: the vLLM server at {url} did not answer {path} within {timeout:g} s")\
            from None
    except (urllib.error.URLError, ConnectionError, OSError, http.client.HTTPException) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):
            raise ToolkitError(f"rl.vllm_timeout: the vLLM server at {url} did not answer {path} within "
                               f"{timeout:g} s") from None
        raise ToolkitError(f"rl.sampler: no vLLM server answers at {url} ({path}: {reason})") from None
    try:
        return json.loads(text)
    except ValueError:
        return text


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        call(url, "/health", timeout=timeout)
        return True
    except ToolkitError:
        return False


def served_models(url: str, timeout: float) -> list[str]:
    """The names the server serves, as /v1/models lists them (none where its answer lists none)."""
    answer = call(url, "/v1/models", timeout=timeout)
    listed = answer.get("data") if isinstance(answer, dict) else None
    return [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)] \
        if isinstance(listed, list) else []


def check_tokenizer(url: str, model: str, tokenizer, timeout: float) -> None:
    """The server's tokenizer must split a probe text as ours does (another model or tokenizer would sample
    token ids that mean something else here)."""
    answer = call(url, "/tokenize", {"model": model, "prompt": PROBE, "add_special_tokens": False}, timeout=timeout)
    theirs = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(theirs, list):
        raise ToolkitError(f"rl.sampler: the server at {url} answered /tokenize without a list of token ids (is it a "
                           f"vLLM server?): {' '.join(str(answer).split())[:200]}")
    ours = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    if theirs != ours:
        raise ToolkitError(f"rl.sampler: the vLLM server at {url} serves another tokenizer than model.path's (it "
                           f"splits a probe text into {theirs[:8] if theirs else theirs}..., ours into {ours[:8]}...); "
                           "serve the same model folder")


def load_adapter(url: str, name: str, path: str, timeout: float) -> None:
    """vLLM's runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING), the adapter replaced in place."""
    call(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True}, timeout=timeout)


def complete(url: str, model: str, prompt: list[int], seed: int, params: dict, stops: list[int],
             timeout: float, vocab: int | None = None) -> tuple[list[int], list[float]]:
    """One completion of a token-id prompt: its token ids (the stop token included where it stopped) and each
    one's log-probability as the server sampled it (NaN where it gave none). The answer is checked here, before
    anything reads it (`check_completion`; `vocab`: the policy's vocabulary, the ids it has rows for)."""
    body = {"model": model, "prompt": prompt, "n": 1, "seed": seed, "logprobs": 0, "return_tokens_as_token_ids": True,
            "stop_token_ids": stops, **params}
    answer = call(url, "/v1/completions", body, timeout=timeout)
    try:
        choice = answer["choices"][0]
        given, values = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
        if not isinstance(given, list) or not isinstance(values, list):
            raise TypeError
        tokens = [int(t.rpartition(":")[2]) for t in given]
        logps = [math.nan if v is None else float(v) for v in values]
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        raise ToolkitError(f"rl.sampler: the vLLM server at {url} answered a completion without token ids and "
                           f"log-probabilities: {str(answer)[:200]}") from None
    stopped_by = choice.get("stop_reason")
    left_out = isinstance(stopped_by, int) and (not tokens or tokens[-1] != stopped_by)
    if choice.get("finish_reason") == "stop" and left_out:
        tokens.append(stopped_by)  # a stop token the server left out of the text's tokens
        logps.append(math.nan)
    check_completion(url, tokens, logps, vocab, params.get("max_tokens"))
    return tokens, logps


def check_completion(url: str, tokens: list[int], logps: list[float], vocab: int | None, most: int | None) -> None:
    """A completion as the server answered it, before it is read: every id one the policy has a row for (a server
    of another model, or of the same tokenizer over more rows, samples others: an IndexError in a later forward),
    one log-probability per token (the correction pairs them), at most the tokens asked for."""
    bad = next((t for t in tokens if vocab is not None and not 0 <= t < vocab), None)
    if bad is not None:
        raise ToolkitError(f"rl.sampler: the vLLM server at {url} answered a completion with token id {bad}, outside "
                           f"the policy's vocabulary of {vocab} tokens (ids 0 to {vocab - 1}): it serves another "
                           "model than model.path")
    if len(logps) != len(tokens):
        raise ToolkitError(f"rl.sampler: the vLLM server at {url} answered a completion of {len(tokens)} token ids "
                           f"with {len(logps)} log-probabilities (one per token expected)")
    if most is not None and len(tokens) > most:
        raise ToolkitError(f"rl.sampler: the vLLM server at {url} answered a completion of {len(tokens)} tokens where "
                           f"at most {most} were asked for (rl.max_new_tokens)")


SERVE_FULL = ("start it with VLLM_SERVER_DEV_MODE=1, PYTHONPATH=toolkit/rollout/worker and --worker-extension-cls "
              "toolkit_vllm_worker.WeightReload (docs/rl.md), or use LoRA")


def unload_adapter(url: str, name: str, timeout: float) -> None:
    """The run's adapter out of a server it did not start, at the end (best effort: the run is over)."""
    try:
        call(url, "/v1/unload_lora_adapter", {"lora_name": name}, timeout=timeout)
    except ToolkitError:
        pass


def reload_weights(url: str, path: str, timeout: float) -> None:
    """Full fine-tuning's weights into the server in place: vLLM's own `reload_weights` from the folder's
    safetensors, by our worker extension (worker/toolkit_vllm_worker.py) through /collective_rpc (offered under
    VLLM_SERVER_DEV_MODE=1), then the prefix cache emptied (its keys and values were computed with the old
    weights)."""
    try:
        call(url, "/collective_rpc", {"method": "toolkit_reload_weights", "args": [path]}, timeout=timeout)
    except ToolkitError as err:
        if " with 404" in str(err):
            raise ToolkitError(f"rl.vllm_url: the vLLM server at {url} has no /collective_rpc, through which full "
                               f"fine-tuning's weights are reloaded: {SERVE_FULL}") from None
        if "toolkit_reload_weights" in str(err):  # vLLM: "Method 'toolkit_reload_weights' is not implemented"
            raise ToolkitError(f"rl.vllm_url: the vLLM server at {url} lacks the toolkit's worker extension: "
                               f"{SERVE_FULL}") from None
        raise ToolkitError(f"{err} while reloading the weights (a failed reload leaves the server's weights "
                           "unusable)") from None
    deadline = time.monotonic() + timeout
    while True:  # vLLM empties no cache while a request holds blocks of it ({"success": false})
        answer = call(url, "/reset_prefix_cache", {}, timeout=timeout)
        if not isinstance(answer, dict) or answer.get("success", True) is not False:
            return
        if time.monotonic() > deadline:
            raise ToolkitError(f"rl.vllm_timeout: the vLLM server at {url} kept its prefix cache for {timeout:g} s "
                               "after the weights were reloaded (requests of someone else in flight?): its cached keys "
                               "and values are of the old weights")
        time.sleep(0.5)


def complete_all(url: str, model: str, prompts: list[list[int]], seeds: list[int], params: dict, stops: list[int],
                 timeout: float, vocab: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt's completion, the requests in flight together."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(PARALLEL, len(prompts))))
    futures = [pool.submit(complete, url, model, p, s, params, stops, timeout, vocab) for p, s in zip(prompts, seeds)]
    try:
        done = [f.result() for f in futures]
    finally:  # a failure: the requests not yet sent are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)
    return [d[0] for d in done], [d[1] for d in done]
