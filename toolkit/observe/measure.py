"""What a run reports while it trains: throughput, model FLOPs utilisation (MFU), peak memory per
rank, where the step time goes (the step profile) and, when asked, a torch profiler trace.

The loop calls `StepClock.lap(phase)` at phase boundaries and `Throughput.row(...)` once a step;
nothing here synchronises the device except on the few steps the profile samples on CUDA.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# metrics.jsonl fields that measure the machine, not what is learned (a resumed run differs in these).
MEASURED = {"time", "tokens_per_second", "target_tokens_per_second", "samples_per_second", "eta_seconds",
            "tflops_per_device", "mfu", "peak_memory_gib", "generation_seconds"}

# Dense peak TFLOP/s per GPU (no sparsity), by the name CUDA reports: (bf16/fp16 tensor cores, fp32).
# Vendor datasheets; a GPU not listed gets no MFU unless train.peak_tflops is set.
PEAK_TFLOPS = [("H100 PCIe", (756.0, 51.0)), ("H100 NVL", (835.0, 60.0)), ("H100", (989.0, 67.0)),
               ("H200", (989.0, 67.0)), ("GH200", (989.0, 67.0)), ("A100", (312.0, 19.5)),
               ("L40S", (362.0, 91.6)), ("L4", (121.0, 30.3)), ("B200", (2250.0, 80.0))]


def peak_tflops(precision: str, override: float | None) -> float | None:
    """The device's dense peak for this precision; None on CPU or an unknown GPU (no MFU then)."""
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, (half, fp32) in PEAK_TFLOPS:
        if key in name:
            return fp32 if precision == "fp32" else half
    return None


@dataclass
class Flops:
    """Training FLOPs per token: `dense` x tokens for the matrix multiplications (6 per weight for
    full fine-tuning: forward, input gradient, weight gradient; 4 under LoRA, whose frozen weights
    get no weight gradient; 6 for the adapters themselves), plus causal attention over each
    document's own length: 6 x layers x query width x length^2 / 2 x 2 (QK^T and AV) per document.
    `extra_forwards`: forwards without gradient per token besides training's own (DPO's reference
    through the disabled adapter: 1), each 2 per weight and a third of the attention's."""
    dense: float
    attention: float  # times the sum over documents of length^2

    @classmethod
    def of(cls, counts, lora: bool, extra_forwards: float = 0) -> "Flops":
        dense = 4 * counts.matmul + 6 * counts.trainable if lora else 6 * counts.matmul
        dense += 2 * counts.matmul * extra_forwards
        return cls(dense=float(dense), attention=(6.0 + 2.0 * extra_forwards) * counts.layers * counts.query)

    def of_batch(self, tokens: int, squared_lengths: int) -> float:
        return self.dense * tokens + self.attention * squared_lengths


def document_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Lengths of the documents a (host) batch holds: padded rows by their mask, packed rows where
    `position_ids` start again at 0 (the padding at a packed row's end is one more document)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1)
    pos = batch["position_ids"].reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1)
    return torch.diff(starts, append=torch.tensor([pos.numel()]))


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak so far: the CUDA allocator's peak on a GPU, the peak RSS on a CPU host."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / (2**30 if sys.platform == "darwin" else 2**20)


class StepClock:
    """Wall time per phase of each step (data, the objective's preparation, forward, backward, optimizer, sync,
    ...). On CUDA the work is asynchronous, so the device is synchronised at each lap only on the steps
    sampled (the first ten after the first, then one in 25); on CPU every step is timed as it runs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.steps, self.step_seconds = 0, 0.0
        self.timed = True
        self.mark = time.perf_counter()

    def start(self, step: int, first_step: int) -> None:
        self.timed = not self.cuda or (first_step < step <= first_step + 10) or step % 25 == 0
        self.counted = step > first_step  # the first step of a launch pays warm-up, left out
        self.current: dict[str, float] = {}
        self.mark = self.began = time.perf_counter()

    def lap(self, phase: str) -> None:
        if not self.timed:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.current[phase] = self.current.get(phase, 0.0) + now - self.mark
        self.mark = now

    def end(self) -> float:
        """Close the step; returns its wall time."""
        now = time.perf_counter()
        seconds = now - self.began
        if self.timed and self.counted:
            self.current["other"] = self.current.get("other", 0.0) + now - self.mark
            for phase, s in self.current.items():
                self.totals[phase] = self.totals.get(phase, 0.0) + s
            self.steps += 1
            self.step_seconds += seconds
        return seconds


HINTS = {
    "data": "batches are read and collated in the training process: data.packing=true gives fewer, fuller "
            "rows; a slow file system or huge rows also show here",
    "forward": "the model's own compute: a bigger train.micro_batch_size uses the device better if memory allows",
    "backward": "the model's own compute (and, on several processes, the gradient all-reduce overlapped with "
                "it): a bigger train.micro_batch_size uses the device better if memory allows",
    "optimizer": "clipping and the optimizer step: with CPU offload this is the CPU's AdamW (ZeRO without "
                 "offload, if `toolkit estimate` says it fits, removes it)",
    "sync": "ranks wait for each other at the step's reductions: their work differs (unequal lengths; "
            "data.packing=true evens it) or the interconnect is slow (`toolkit doctor` measures it)",
    "other": "logging and bookkeeping between steps",
}


def profile_report(clock: StepClock, extra: dict[str, float], gradient_checkpointing: bool,
                   preparation=None) -> tuple[str, dict]:
    """The end-of-run step profile: each phase's share of step time, the largest named with a hint.
    `extra`: seconds spent outside steps (eval, checkpoints, samples). `preparation`: the objective's
    (`objectives.Preparation`: what its step_batches does, under its own name and with its own hint; None where it
    does nothing). That phase is left out of the line where it took under half a percent (kept in profile.json)."""
    if clock.steps == 0:
        return "step profile: no step was timed (a launch needs two steps)", {}
    hints = {**HINTS, **({preparation.phase: preparation.hint} if preparation is not None else {})}
    optional = {preparation.phase} if preparation is not None else set()
    shares = {p: s / clock.step_seconds for p, s in sorted(clock.totals.items(), key=lambda kv: -kv[1])}
    largest = next(iter(shares))
    hint = hints.get(largest, "")
    if largest in ("forward", "backward") and gradient_checkpointing:
        hint = ("gradient checkpointing recomputes each layer's forward in backward (about a third more compute): "
                "turn it off if memory allows, or raise train.micro_batch_size")
    per_step = clock.step_seconds / clock.steps
    parts = ", ".join(f"{p} {100 * s:.0f}%" for p, s in shares.items() if p not in optional or s >= 0.005)
    outside = "; ".join(f"{k} {v:.1f} s in all" for k, v in extra.items() if v > 0)
    line = (f"step profile over {clock.steps} timed step(s), {per_step:.3f} s each: {parts}"
            + (f"; {outside}" if outside else "") + f". Largest: {largest}: {hint}")
    data = {"timed_steps": clock.steps, "seconds_per_step": per_step, "shares": shares, "outside_steps": extra,
            "largest": largest, "hint": hint}
    return line, data


class Throughput:
    """Per-step figures for metrics.jsonl and the bar: tokens, target tokens and rows per second,
    achieved TFLOP/s and MFU per device, ETA, and every rank's peak memory."""

    def __init__(self, flops: Flops | None, peak: float | None, world: int, total_steps: int, start_step: int):
        self.flops, self.peak, self.world = flops, peak, world
        self.total_steps, self.recent = total_steps, []

    def row(self, step: int, seconds: float, *, tokens: int, targets: int, rows: int, squared_lengths: int,
            peaks_gib: list[float]) -> dict:
        self.recent = (self.recent + [seconds])[-20:]
        row = {"tokens_per_second": tokens / seconds, "target_tokens_per_second": targets / seconds,
               "samples_per_second": rows / seconds,
               "eta_seconds": round((self.total_steps - step) * statistics.median(self.recent), 1)}
        if self.flops is not None:
            tflops = self.flops.of_batch(tokens, squared_lengths) / seconds / self.world / 1e12
            row["tflops_per_device"] = tflops
            row["mfu"] = tflops / self.peak if self.peak else None
        row["peak_memory_gib"] = [round(p, 3) for p in peaks_gib]
        return row


class Trace:
    """train.profile_steps [first, last]: a torch profiler trace of those steps, one file per rank."""

    def __init__(self, steps: list[int] | None, run_dir: Path, rank: int, device: torch.device):
        self.steps, self.path, self.profiler = steps, run_dir / "profile" / f"trace-rank{rank}.json", None
        self.device = device

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()

    def after(self, step: int) -> str | None:
        if self.profiler is None or step != self.steps[1]:
            return None
        self.profiler.__exit__(None, None, None)
        from ..storage import disk

        with disk.writing("profile trace", self.path):
            self.path.parent.mkdir(exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
        self.profiler = None
        return (f"profile: steps {self.steps[0]}-{self.steps[1]} traced into {self.path.parent}/ "
                "(open a trace in https://ui.perfetto.dev or chrome://tracing)")


def write_profile(run_dir: Path, data: dict) -> None:
    """profile.json; a full or read-only disk ends the run in one line (storage.disk), as every write of a run."""
    from ..storage import disk

    with disk.writing("profile", run_dir / "profile.json", remove=False):
        (run_dir / "profile.json").write_text(json.dumps(data, indent=1) + "\n")
