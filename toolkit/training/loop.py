"""The loop: `fit` trains from the run's step to the last, one `train_step` (one optimizer step)
at a time, with evaluation, metrics and checkpoints between steps; `save_final` writes `final/`.

None of it names a backend: the run's backend object (`backends/`) holds what differs. The loss of
a batch comes from the run's objective (`objectives.Objective`); everything that watches the run
without changing what it learns sits behind the monitor (`observe/monitor.py`).
"""

from __future__ import annotations

import collections
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import backends, faults
from ..config import Recipe
from ..data.batching import EpochSampler
from ..errors import EXIT_NONFINITE, EXIT_PREEMPTED
from ..model import base_identity
from ..model.hub import resolve_model
from ..model.load import compiled_graphs, config_overrides
from ..observe import measure
from ..observe.monitor import Monitor
from ..stops import Preemption, TrainingStopped
from ..storage import checkpoint
from . import card
from .objectives import Objective
from .samples import Samples


@dataclass
class Run:
    """What `fit` trains with, built once by `build`: the backend and its accelerator, the prepared
    model, optimizer, scheduler and loaders, the training state, the objective and the monitor. A
    test can build one and call `fit`."""
    backend: backends.Backend
    accelerator: Any
    recipe: Recipe
    model: Any
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    sampler: EpochSampler
    state: checkpoint.TrainerState
    total_steps: int
    out: Path
    objective: Objective
    monitor: Monitor
    preemption: Preemption
    samples: Samples
    speed: measure.Throughput
    offload: Any  # the context each forward runs in (model.activation_offload)



def fit(run: Run) -> dict:
    """Train from `run.state.step` to `run.total_steps`; returns the last metrics row."""
    acc, t, state, monitor = run.accelerator, run.recipe.train, run.state, run.monitor
    batches = global_batches(run.train_loader, run.sampler, t.gradient_accumulation_steps, run.objective.iterations)
    row = {}
    if state.step == 0:
        row = monitor.metrics.write({"step": 0, "epoch": 0.0, **evaluation(run, 0)})
    progress = tqdm(total=run.total_steps, initial=state.step, disable=not acc.is_main_process,
                    dynamic_ncols=True, desc="training",
                    mininterval=0.5 if sys.stderr.isatty() else 30)  # logs that are files get few updates
    run.model.train()
    try:
        for step in range(state.step + 1, run.total_steps + 1):
            row, stop_requested = train_step(run, step, batches)
            if step % t.log_every_steps == 0 or step == run.total_steps:
                say(acc, f"step {step}/{run.total_steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
                         f"grad_norm {row['grad_norm']:.3f} | {speed_text(row)}")
            if state.nonfinite_in_a_row >= t.max_nonfinite_steps:
                monitor.metrics.write(row)
                raise TrainingStopped(
                    f"train: loss or gradient not finite for {state.nonfinite_in_a_row} optimizer steps in a row "
                    f"(steps {step - state.nonfinite_in_a_row + 1}-{step}, none applied); stopped. Last good "
                    f"checkpoint: {last_checkpoint(run.out)}", EXIT_NONFINITE)
            if (t.eval_every_steps and step % t.eval_every_steps == 0) or step == run.total_steps:
                row.update(evaluation(run, step))
            monitor.metrics.write(row)
            progress.set_postfix_str(f"loss {row['loss']:.4f} | {speed_text(row, short=True)}", refresh=False)
            progress.update(1)
            every = run.recipe.checkpoint.every_steps
            stop_requested = stop_requested and run.objective.resumable_after(step)  # else at the next step it can
            if (every and (step % every == 0 or step == run.total_steps)) or stop_requested:
                path = save_checkpoint(run, step)
                if stop_requested:
                    raise TrainingStopped(f"preempted: checkpoint {path} saved at step {step}; "
                                          "run again with resume=auto to continue", EXIT_PREEMPTED)
    finally:
        progress.close()  # before any stop message, so the bar does not trail it
    line, profile = monitor.profile_report(run.recipe.model.gradient_checkpointing, run.objective.preparation())
    say(acc, line)
    if acc.is_main_process and profile:
        measure.write_profile(run.out, profile)
    return row


def train_step(run: Run, step: int, batches) -> tuple[dict, bool]:
    """One optimizer step over the micro-batches of one global batch; returns (its metrics row,
    whether any rank was asked to stop)."""
    acc, t, state, monitor, model = run.accelerator, run.recipe.train, run.state, run.monitor, run.model
    rank, world = acc.process_index, acc.num_processes
    monitor.begin_step(step)
    with monitor.phase("data", step):
        epoch, seen, micro_batches = next(batches)
        later = batches.peek(min(run.objective.lookahead, run.total_steps - step))  # rl.max_staleness samples ahead
    micro_batches = prepare_batches(monitor, run.objective, model, micro_batches, step, later)
    with monitor.phase("data", step):
        # Exact accumulation: every unit of the global batch (all micro-batches, all ranks) weighs
        # the same, so the loss is a sum divided by the global count of units. Counted on the
        # host, before the batches move: no device synchronisation for it.
        local = torch.tensor(run.objective.host_counts(micro_batches), dtype=torch.float64)
        # Where rows are split across ranks, each rank keeps its part (and counted the whole rows).
        micro_batches = [to_device(run.backend.shard_sequence(b), acc.device) for b in micro_batches]
    with monitor.phase("counts", step, lap="sync"):
        split = run.backend.sequence_parallel
        n_units, n_tokens, squared_lengths = (int(x) // split for x in acc.reduce(local.to(acc.device), "sum").tolist())
    n_units = max(n_units, 1)  # none (online RL, every completion left out as truncated): loss 0, nothing learned
    # The backends divide the gradients summed over ranks by `gradient_average()` ranks and accelerate by the
    # accumulation steps; this factor undoes both so the gradient is sum(unit losses) / n_units.
    scale = run.backend.gradient_average() * t.gradient_accumulation_steps / n_units
    clip = t.max_grad_norm if t.max_grad_norm > 0 else math.inf  # inf: no clipping, norm still measured
    loss_sum = torch.zeros((), device=acc.device)
    lr = run.optimizer.param_groups[0]["lr"]  # this step's (a DeepSpeed scheduler steps inside the last backward)
    try:
        for i, batch in enumerate(micro_batches):
            with acc.accumulate(model):
                with monitor.phase("forward", step, i), run.offload():
                    faults.before_forward(step, i, rank)
                    losses = run.objective.loss_sum(model, batch)
                    if faults.nonfinite(step, i):  # test seam: a non-finite loss and gradient
                        losses = losses * float("nan")
                with monitor.phase("backward", step, i):
                    acc.backward(losses * scale)
                    loss_sum += losses.detach()
                if acc.sync_gradients:  # the last micro-batch of this optimizer step
                    with monitor.phase("optimizer", step):
                        grad_norm = as_float(acc.clip_grad_norm_(model.parameters(), clip))
                        applied = run.backend.optimizer_step(model, run.optimizer, grad_norm)
                        if applied:  # a skipped step does not advance the schedule
                            run.scheduler.step()
                        run.optimizer.zero_grad(set_to_none=True)
    except Exception as e:
        reason = run.backend.step_failure(e)
        if reason is None:
            raise
        raise TrainingStopped(f"train: {reason} at step {step}; stopped. Last good checkpoint: "
                              f"{last_checkpoint(run.out)}", EXIT_NONFINITE) from None

    # One reduction for the loss, "a rank was asked to stop" (so all ranks agree), each rank's
    # peak memory (in its own slot), and the objective's own metrics (the router's aux loss).
    with monitor.phase("sync", step):
        extra = run.objective.step_metrics(acc.device)
        flags = torch.zeros(1 + world, dtype=torch.float64)
        flags[0], flags[1 + rank] = float(run.preemption.requested), measure.peak_memory_gib(acc.device)
        sums = torch.stack([loss_sum.double(), *extra.values()])
        totals = acc.reduce(torch.cat([sums, flags.to(acc.device)]), reduction="sum").tolist()
        loss = totals[0] / n_units
        extra = run.objective.finish_metrics(dict(zip(extra, totals[1:len(sums)])), n_units)
        stop_requested, peaks = totals[len(sums)] > 0, totals[len(sums) + 1:]
    scale_now = run.backend.loss_scale(model)
    state.step, state.tokens_seen, state.data_position = step, state.tokens_seen + n_tokens, [epoch, seen]
    state.skipped_steps += not applied
    diverging = counts_toward_stop(loss, grad_norm, scale_now, applied)
    state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if diverging else 0
    elapsed, trace_line = monitor.end_step(step)
    if trace_line:
        say(acc, trace_line)
    per_epoch = run.sampler.steps_per_epoch * run.sampler.global_batch  # samples an epoch trains on
    row = {"step": step, "epoch": round(epoch + seen / per_epoch, 4),
           "loss": loss, **extra, "lr": lr, "grad_norm": grad_norm, "tokens": state.tokens_seen,
           **run.speed.row(step, elapsed, tokens=n_tokens, targets=n_units, rows=run.sampler.global_batch,
                           squared_lengths=squared_lengths, peaks_gib=peaks),
           "skipped_steps": state.skipped_steps, "loss_scale": scale_now, "time": round(time.time(), 3)}
    if run.recipe.train.compile:  # a count that still rises after the first steps means recompiling
        row["compiled_graphs"] = compiled_graphs()
    return row, stop_requested


def prepare_batches(monitor: Monitor, objective: Objective, model, micro_batches: list, step: int,
                    later: list | None = None) -> list:
    """What the loss is taken on this step (`objective.step_batches`: online RL samples and scores here, KTO
    takes its KL estimate), timed and watched under the objective's own name for that work; an objective that
    returns the loader's batches has its (next to no) time counted with the data. `later`: the next steps'
    micro-batches, as many as the objective looks ahead (`Objective.lookahead`)."""
    prep = objective.preparation()
    with monitor.phase("prepare" if prep else "data", step, lap=prep.phase if prep else None,
                       detail=prep.doing if prep else ""):
        return objective.step_batches(model, micro_batches, step, later or [])


def evaluation(run: Run, step: int) -> dict:
    """The eval loss (and the samples of train.sample_prompts) at `step`, said and returned as metrics."""
    where = "step 0" if step == 0 else f"step {step}/{run.total_steps}"
    found = {}
    with run.monitor.outside_steps("eval", step, "eval"):
        found.update(evaluate(run.accelerator, run.model, run.eval_loader, run.objective, run.monitor, step))
        if len(run.eval_loader.dataset):
            say(run.accelerator, f"{where} | " + " | ".join(f"{k} {v:.4f}" for k, v in found.items()))
        answered = run.objective.eval_samples()  # online RL: a few eval answers (with their rewards)
        for s in answered:
            say(run.accelerator, f"{where} | sample {s['prompt']!r} -> {s['answer']!r}"
                + (f" (reward {s['reward']:g})" if "reward" in s else ""))
        if answered:
            found["samples"] = answered
        if run.samples:
            found["samples"] = show_samples(run.accelerator, run.samples(run.model), where)
    return found


def save_checkpoint(run: Run, step: int) -> Path:
    path = checkpoint.checkpoint_dir(run.out) / f"step-{step:06d}"
    run.monitor.watchdog.begin("checkpoint", step)
    took = checkpoint.save(run.backend, path, run.state, run.recipe.checkpoint, run.model, run.optimizer,
                           run.scheduler, run.objective.save_state)
    run.monitor.watchdog.done()
    run.monitor.outside["checkpoints"] += took["total"]
    say(run.accelerator, f"checkpoint {path.name} in {took.pop('total'):.2f} s ("
                         + ", ".join(f"{part} {s:.2f} s" for part, s in took.items()) + ")")
    return path


def last_checkpoint(out: Path) -> str:
    kept = checkpoint.complete_checkpoints(out)
    return str(kept[-1]) if kept else "none"


@torch.no_grad()
def evaluate(accelerator, model, eval_loader, objective: Objective, monitor: Monitor | None = None,
             step: int = 0) -> dict:
    """`eval_loss`: the unit-weighted mean loss over the whole eval set (each rank holds a disjoint
    share), None without eval data; and the objective's own metrics over it (`eval_reward_accuracy`...)."""
    if len(eval_loader.dataset) == 0:
        return {"eval_loss": None}
    if monitor is not None:
        monitor.watchdog.at("eval", step)
    if step > 0:
        faults.at("eval")
    model.eval()
    objective.step_metrics(accelerator.device)  # a clean start: only the eval batches' metrics below
    objective.begin_eval(model, eval_loader)
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in eval_loader:
        batch = to_device(batch, accelerator.device)
        totals[0] += objective.loss_sum(model, batch).double()
        totals[1] += objective.units(batch)
    model.train()
    extra = objective.step_metrics(accelerator.device)
    totals = accelerator.reduce(torch.cat([totals, *(v.reshape(1) for v in extra.values())]), reduction="sum").tolist()
    n = totals[1]
    metrics = objective.finish_metrics(dict(zip(extra, totals[2:])), n)
    return {**({"eval_loss": totals[0] / n} if objective.has_eval_loss else {}),
            **{f"eval_{k}": v for k, v in metrics.items()
               if k in objective.eval_metrics}}  # the per-pair rewards; not the router's training-only loss


class Batches:
    """The global batches (`global_batches`), with a look at the next ones' micro-batches: `peek(n)`."""

    def __init__(self, items):
        self.items, self.seen = items, collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        return self.seen.popleft() if self.seen else next(self.items)

    def peek(self, n: int) -> list:
        while len(self.seen) < n:
            self.seen.append(next(self.items))
        return [micro_batches for _, _, micro_batches in list(self.seen)[:max(n, 0)]]


def global_batches(loader, sampler, accumulation: int, repeat: int = 1) -> Batches:
    """(epoch, samples of that epoch seen after this step, the micro-batches of one optimizer step), epoch after
    epoch, from the sampler's resume position; each global batch `repeat` times (an objective's `iterations`)."""
    return Batches(_global_batches(loader, sampler, accumulation, repeat))


def _global_batches(loader, sampler, accumulation: int, repeat: int):
    epoch = sampler.resume_epoch
    while True:
        loader.set_epoch(epoch)
        it = iter(loader)
        start = sampler.resume_offset if epoch == sampler.resume_epoch else 0
        for i in range(sampler.steps_in(epoch)):
            micro_batches = [next(it) for _ in range(accumulation)]
            for _ in range(repeat):
                yield epoch, start + (i + 1) * sampler.global_batch, micro_batches
        epoch += 1


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch's tensors on `device` (copies that do not wait, from pinned memory on CUDA); its
    numbers (the longest document, for varlen attention) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def speed_text(row: dict, short: bool = False) -> str:
    """Throughput, MFU and the largest rank's peak memory, for the log line and the bar."""
    parts = [f"{row['tokens_per_second']:,.0f} tok/s"]
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    elif row.get("tflops_per_device") is not None and not short:
        parts.append(f"{row['tflops_per_device']:.2f} TFLOP/s")
    parts.append(f"peak {max(row['peak_memory_gib']):.2f} GiB")
    if not short:
        parts.append(f"ETA {row['eta_seconds'] / 60:.1f} min")
    return " | ".join(parts)



def save_final(run: Run, tokenizer) -> None:
    """The run's result, `final/`: a signal from here on waits for it (a second one more than 2 s
    later aborts)."""
    accelerator, recipe, out, preemption = run.accelerator, run.recipe, run.out, run.preemption
    with preemption.deferred():
        preemption.disarm()
        if recipe.train.compile:  # the same count for a longer run: no step recompiled
            accelerator.print(f"compile: {compiled_graphs()} graphs built")
        run.monitor.watchdog.begin("save", run.total_steps)
        extra = None
        if accelerator.is_main_process:
            folder = None if recipe.model.preset else Path(resolve_model(recipe.model.path, recipe.model.revision))
            extra = {"README.md": card.model_card(recipe, run.state, card.read_rows(out / "metrics.jsonl"), folder)}
            if recipe.lora.enabled:  # which base the adapter belongs to
                extra[base_identity.RECORD] = base_identity.record(folder or out / "base-model",
                                                                   config_overrides(recipe.model))
        run.backend.save_model(run.model, tokenizer, out / "final", extra_files=extra)
        run.monitor.watchdog.done()
    accelerator.print(f"saved {out / 'final'}")
    if preemption.requested:
        accelerator.print(f"{preemption.signal_name} arrived after the last optimizer step; the run finished first: "
                          f"{out / 'final'} is complete")

def show_samples(accelerator, answered: list[dict], where: str) -> list[dict]:
    for s in answered:
        say(accelerator, f"{where} | sample {s['prompt']!r} -> {s['answer']!r}")
    return answered


def say(accelerator, line: str) -> None:
    """A log line from the main process that does not break the progress bar."""
    if accelerator.is_main_process:
        tqdm.write(line)



def counts_toward_stop(loss: float, grad_norm: float, loss_scale: float | None, applied: bool = False) -> bool:
    """Whether this optimizer step counts toward train.max_nonfinite_steps. An applied step never
    does: the stop is for runs whose steps are being skipped. Otherwise a non-finite loss
    always does. A non-finite gradient does unless a dynamic loss scale (fp16) can still be
    lowered: overflowing and halving the scale is how loss scaling finds its level, and a run
    started at a high scale overflows many times in a row. `loss_scale` is the scale after this
    step's update; below 1, the step overflowed at a scale of 1 or less (the gradient itself is
    not finite), which is divergence like any other."""
    if applied:
        return False
    if not math.isfinite(loss):
        return True
    if math.isfinite(grad_norm):
        return False
    return loss_scale is None or not loss_scale >= 1  # NaN scale: unknown, count it


def as_float(x) -> float:
    if x is None:
        return float("nan")
    if hasattr(x, "full_tensor"):  # a DTensor from a sharded model
        x = x.full_tensor()
    return float(x)

