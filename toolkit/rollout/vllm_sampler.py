"""Online RL's completions from a vLLM server (rl.sampler: vllm), as TRL's `use_vllm` in server mode.

The main process starts the server (`server.py`) at the first generated batch, once the run folder is
open (its log goes there), unless rl.vllm_url names one, and the other ranks learn its address from it.
Before each generated batch the policy's weights as they stand go to the server, every rank waiting:
- LoRA: the adapter's tensors only (`Backend.trainable_weights`), written to `rollout-adapter/step-N/` in the
  run folder by the main process and loaded in place (`/v1/load_lora_adapter`; a new folder each time, as
  vLLM's prefix cache is keyed by the adapter's name and path, so no cached keys and values of an older
  adapter are reused);
- full fine-tuning: the trained weights, gathered one tensor at a time (a host copy on the main process
  only, in train.precision's dtype), written to `rollout-weights/step-N/model.safetensors` under the checkpoint's
  names and reloaded in place by vLLM's workers (`reload_weights` through `/collective_rpc`, offered under
  VLLM_SERVER_DEV_MODE=1, by our worker extension), the prefix cache then emptied and the file removed. This works on a
  CPU host (vLLM's NCCL and CUDA-IPC weight transfers need GPUs); it costs a write and a read of the weights
  per generated batch, which the run reports after the first one.
Then each rank asks for its own prompts' completions, one request per completion with its own seed, and gets
back the sampled tokens' ids and log-probabilities (the server runs with --logprobs-mode processed_logprobs:
after temperature and the cuts, as TRL requires for its correction). A failed request on any rank stops every
rank in one line. The loss corrects for the server's probabilities differing from the trained model's
(`policy_loss.sampler_correction`)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config.objectives import default_vllm_python, server_flag
from ..errors import ToolkitError
from ..storage import disk
from . import client
from .server import Server, explain

ADAPTER = "policy"  # the name the server knows the adapter by, with the run's own suffix (`VLLMSampler.adapter`)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class VLLMSampler:
    def __init__(self, cfg, *, model_path: str, tokenizer, backend, out: Path, seed: int, max_model_len: int,
                 precision: str, lora_rank: int):
        self.cfg, self.tokenizer, self.backend = cfg, tokenizer, backend
        self.accelerator = backend.accelerator
        self.out = out
        self.server: Server | None = None
        self.url = cfg.vllm_url
        self.base = str(model_path)
        self.ready = False
        self.lora = lora_rank is not None
        # two runs at one server each sample through their own adapter (the main process's pid and the time)
        self.adapter = f"{ADAPTER}-{os.getpid()}-{time.time_ns() % 10**9}"
        self.reported = False
        self.vocab = None  # the policy's vocabulary (the ids it has rows for), at the first sync
        self.settings = {"max_model_len": max_model_len, "dtype": DTYPES[precision], "seed": seed,
                         "lora_rank": lora_rank, "args": list(cfg.vllm_args)}
        if self.url is None and torch.cuda.is_available() and \
                "--gpu-memory-utilization" not in {server_flag(a) for a in cfg.vllm_args}:
            raise ToolkitError("rl.vllm_args: the server the run starts shares the first GPU of this node with "
                               "training (vLLM takes 92% of a GPU by default): give its share, e.g. "
                               "[--gpu-memory-utilization, '0.3'], or run a server on other GPUs and give rl.vllm_url")

    def describe(self) -> str:
        where = f"at {self.url}" if self.cfg.vllm_url else "started by the run (log: vllm.log)"
        correction = (f"the loss corrected for its log-probabilities ({self.cfg.vllm_importance_sampling_mode}, "
                      f"bounds [{self.cfg.vllm_importance_sampling_clip_min}, "
                      f"{self.cfg.vllm_importance_sampling_clip_max}])"
                      if self.cfg.vllm_importance_sampling_correction else "no correction for its log-probabilities")
        synced = ("the LoRA adapter loaded into it" if self.lora else
                  "the policy's weights reloaded into it (rollout-weights/)")
        return f"a vLLM server {where}, {synced} before each generated batch; {correction}"

    def start(self) -> None:
        """Wait for the server (the main process), check it serves our tokenizer, and tell every rank its URL."""
        if self.ready:
            return
        problem = None
        if self.accelerator.is_main_process:
            try:
                if self.url is None:
                    python = Path(self.cfg.vllm_python).expanduser() if self.cfg.vllm_python else default_vllm_python()
                    self.server = Server(python, self.base, self.out / "vllm.log", **self.settings)
                    # the bar stays at 0 meanwhile: say why (a CPU host: about a minute; a GPU: its CUDA graphs too)
                    print(f"rl.sampler: starting the vLLM server (once per run; the first batch waits for it, "
                          f"about a minute, at most rl.vllm_timeout {self.cfg.vllm_timeout:g} s); its log: "
                          f"{self.out / 'vllm.log'}", file=sys.stderr, flush=True)
                    self.server.wait_ready(self.cfg.vllm_timeout)
                    print(f"rl.sampler: the vLLM server answers at {self.server.url}", file=sys.stderr, flush=True)
                    self.url = self.server.url
                else:
                    models = client.served_models(self.url, self.cfg.vllm_timeout)
                    self.base = models[0] if models else self.base
                client.check_tokenizer(self.url, self.base, self.tokenizer, self.cfg.vllm_timeout)
            except ToolkitError as err:  # wait_ready's own line where the server did not start; a request's explained
                started = self.server is None or self.server.alive()
                problem = explain(str(err), self.server) if started else str(err)
        self.url, self.adapter, problem = self.broadcast((self.url, self.adapter, problem))
        if problem:
            raise ToolkitError(problem)
        self.ready = True

    def broadcast(self, value):
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def sync(self, model, step: int) -> None:
        """The policy's weights as they stand (the adapter, or the trained weights) into the server, started first
        if it is not yet (a collective: every rank calls it)."""
        self.start()
        if self.vocab is None:  # every id the server answers is checked against it (client.check_completion)
            self.vocab = self.accelerator.unwrap_model(model).config.get_text_config().vocab_size
        started = time.perf_counter()
        problem, folder = None, self.out / ("rollout-adapter" if self.lora else "rollout-weights") / f"step-{step:06d}"
        dtype = None if self.lora else getattr(torch, self.settings["dtype"])  # train.precision's: what autocast
        try:  # computes with; half the bytes in bf16
            weights = self.backend.trainable_weights(model, dtype)
        except Exception as err:  # noqa: BLE001 - the main process's host copy failed; the gathers went on
            weights, problem = {}, f"rl.sampler: the policy's weights could not be gathered for the server: {err!r}"
        if self.accelerator.is_main_process and problem is None:
            try:
                module = self.accelerator.unwrap_model(model)
                problem = self.send_adapter(module, weights, folder) if self.lora else \
                    self.send_weights(module, weights, folder)
            except ToolkitError as err:
                problem = self.explained(str(err))
            except OSError as err:
                problem = f"rl.sampler: could not write the policy's weights for the vLLM server to {folder}: {err}"
            except Exception as err:  # noqa: BLE001 - every rank waits below: a failure here must reach them
                problem = f"rl.sampler: the policy's weights could not go into the vLLM server: {err!r}"
            if problem is None and not self.reported:
                size = sum(w.numel() * w.element_size() for w in weights.values()) / 2**20
                tqdm.write(f"rl: the policy's {'adapter' if self.lora else 'weights'} ({size:,.1f} MiB) went into "
                           f"the vLLM server in {time.perf_counter() - started:.2f} s (gathered, written, loaded); "
                           "so before each generated batch")
                self.reported = True
        problem = self.broadcast(problem)
        if problem:
            raise ToolkitError(problem)

    def send_adapter(self, module, weights: dict, folder: Path) -> None:
        """The main process's part of a LoRA sync: the adapter written to `folder` and loaded in place; the older
        folders removed (the server holds the loaded adapter in memory)."""
        with disk.writing("rl.sampler: the adapter for the vLLM server", folder, error=ToolkitError):
            module.save_pretrained(str(folder), state_dict=weights, safe_serialization=True)
        client.load_adapter(self.url, self.adapter, str(folder.resolve()), self.cfg.vllm_timeout)
        for older in folder.parent.iterdir():
            if older != folder:
                shutil.rmtree(older, ignore_errors=True)

    def send_weights(self, module, weights: dict, folder: Path) -> str | None:
        """The main process's part of a full fine-tuning sync: the weights under the checkpoint's names
        (transformers renames or fuses some on loading, MoE experts among them) written to `folder`, reloaded by
        the server, and removed once read; a failed reload's line, with the server's own last error."""
        from safetensors.torch import save_file
        from transformers.core_model_loading import revert_weight_conversion

        weights = revert_weight_conversion(module, weights)
        shutil.rmtree(folder.parent, ignore_errors=True)
        folder.mkdir(parents=True)
        needed = sum(w.numel() * w.element_size() for w in weights.values())
        with disk.writing("rl.sampler: the weights for the vLLM server", folder, needed, ToolkitError):
            save_file({n: w.contiguous() for n, w in weights.items()}, str(folder / "model.safetensors"))
        try:
            client.reload_weights(self.url, str(folder.resolve()), self.cfg.vllm_timeout)
        except ToolkitError as err:
            return self.explained(str(err), reloading=True)
        finally:  # read by then: no copy of the whole model is left in the run folder
            shutil.rmtree(folder.parent, ignore_errors=True)
        return None

    def sample(self, prompts: list[list[int]], seeds: list[int], stops: list[int],
               together: bool = True) -> tuple[list, list]:
        """Each prompt's completion and its tokens' log-probabilities under the server's sampling. `together`:
        every rank stops on one rank's failure (a collective); False (sampling ahead, in a thread of its own,
        rl.max_staleness): this rank's failure is raised here only and its caller has the ranks agree."""
        c = self.cfg
        params = {"max_tokens": c.max_new_tokens, "temperature": c.temperature, "top_p": c.top_p,
                  "top_k": c.top_k if c.top_k > 0 else -1, "min_p": c.min_p or 0.0,
                  "repetition_penalty": c.repetition_penalty}
        made, problem = None, None
        try:
            model = self.adapter if self.lora else self.base
            made = client.complete_all(self.url, model, prompts, seeds, params, stops, c.vllm_timeout,
                                       self.vocab)
        except ToolkitError as err:
            problem = self.explained(str(err))
        if together and self.accelerator.num_processes > 1:  # every rank stops on one's failure, none waits
            from accelerate.utils import gather_object

            problem = next((p for p in gather_object([problem]) if p), None)
        if problem:
            raise ToolkitError(problem)
        return made

    def explained(self, line: str, reloading: bool = False) -> str:
        """A request's failure, with the server's own words on why (`server.explain`: its exit where it died, the
        cause in vllm.log where vLLM says only "see stack trace (above)", or where a reload failed)."""
        return explain(line, self.server, from_log=reloading) + "; the last checkpoint is intact"

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        elif self.ready and self.lora and self.accelerator.is_main_process:  # a server of yours keeps no adapter
            client.unload_adapter(self.url, self.adapter, min(self.cfg.vllm_timeout, 30.0))
        if self.accelerator.is_main_process:  # the last adapter sent: the server no longer reads it
            shutil.rmtree(self.out / "rollout-adapter", ignore_errors=True)

