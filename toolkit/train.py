"""The training loop: build everything from the recipe, let Accelerate prepare it, train, save.

`run()` builds; `fit()` is the loop and takes every object it uses as an argument. Neither names
a backend: the launch config decides DDP, FSDP or DeepSpeed, and `backend.py` holds what differs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import backend, base_identity, checkpoint, disk, faults, observe, run_folder
from .config import Recipe
from .errors import ToolkitError
from .data import (IGNORE, Collator, EpochSampler, EvalShardSampler, build_datasets, label_audit, packing_is_isolated,
                   remove_partial_data)
from .sizing import count_model
from .hub import is_hub_id, resolve_model
from .loss import token_loss_sum, use_token_loss
from .model import (DTYPES, apply_lora, build_model, build_tokenizer, compile_layers, compiled_graphs,
                    count_parameters, isolation_probe)
from .stops import EXIT_NONFINITE, EXIT_PREEMPTED, Preemption, TrainingStopped
from .samples import Samples
from .summary import run_summary
from .watchdog import Watchdog


def run(recipe: Recipe, source: str = "recipe", preemption: Preemption | None = None) -> dict:
    """Train as the recipe says; returns the last metrics row. `preemption`: the signal handler,
    installed by the CLI before the slow imports so that a signal at any moment gets its line.
    The run holds `output_dir`'s lock from the start to the end, whatever the end."""
    out = Path(recipe.output_dir)
    preemption = preemption or Preemption()
    accelerator = backend.make_accelerator(recipe, source)
    lock = run_folder.RunLock(out)
    try:
        return _run(accelerator, recipe, preemption, lock)
    finally:
        lock.release()  # also on a refusal: the folder is as it was (removed again if this run made it)


def _run(accelerator, recipe: Recipe, preemption: Preemption, lock: run_folder.RunLock) -> dict:
    from accelerate.utils import set_seed

    out = Path(recipe.output_dir)
    log = accelerator.print
    t = recipe.train
    resume_from = run_folder.open_run(accelerator, recipe, lock)

    set_seed(recipe.seed)  # same initial weights on every rank and every backend
    tokenizer = build_tokenizer(recipe.model)
    samples = Samples(recipe, tokenizer, accelerator)  # train.sample_prompts rendered now: a bad one fails here
    model_cfg = recipe.model
    if recipe.data.padding_free and model_cfg.attn_implementation == "sdpa":  # sdpa would build a dense mask
        model_cfg = dataclasses.replace(model_cfg, attn_implementation="varlen")
        log("attention: varlen (data.padding_free; sdpa would mask the whole micro-batch)")
    faults.at("model")
    model = build_model(model_cfg, DTYPES[recipe.model.dtype], DTYPES[recipe.train.precision])
    flops = observe.Flops.of(count_model(model.config, "model", recipe.lora), recipe.lora.enabled)
    use_token_loss(model, t.loss, t.loss_chunk_tokens)  # in the forward, where every backend has whole weights
    packing, padding_free = recipe.data.packing, recipe.data.padding_free
    if (packing or padding_free) and not packing_is_isolated(isolation_probe(model)):
        log("warning: this model lets packed documents attend to each other; padding instead of "
            + ("packing" if packing else "data.padding_free"))
        packing = padding_free = False
    base_weights = None
    if recipe.lora.enabled:
        if recipe.model.preset is not None:
            # A preset has no folder of its own: its weights are saved beside the run (below) so
            # that the adapter in final/ loads with plain peft.
            base_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            base_config = model.config
        model = apply_lora(model, recipe.lora)
        if recipe.model.preset is not None:
            model.peft_config["default"].base_model_name_or_path = str((out / "base-model").resolve())
        elif not is_hub_id(recipe.model.path):  # absolute: the adapter loads from any working directory
            model.peft_config["default"].base_model_name_or_path = str(Path(recipe.model.path).resolve())
    if t.compile:
        backend.check_compile(accelerator, recipe)
        log(f"compile: {compile_layers(model)} decoder layers (the first steps compile them)")
    trainable, total = count_parameters(model)
    log(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    if accelerator.is_main_process and (warning := run_folder.check_free_space(out, recipe, trainable, total)):
        log(f"warning: {warning}")

    # The main process of each node prepares the data; the others wait on the file system, not in a
    # collective that a long tokenization could time out.
    with preemption.abrupt(lock.release, remove_partial_data):  # a signal while datasets' workers tokenize
        data = build_datasets(recipe.data, tokenizer, recipe.seed, packing, prepares=accelerator.is_local_main_process)
    for line in data.lines:
        log(f"data: {line}")
    for line in data.warnings:
        log(f"warning: {line}")
    if accelerator.is_main_process:  # what the loss is taken on, before an hour is spent on it
        log(f"data: {label_audit(data.train[0], tokenizer)}")
    world = accelerator.num_processes
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * world
    sampler = EpochSampler(len(data.train), global_batch, recipe.seed)
    if sampler.steps_per_epoch == 0:
        raise ToolkitError(f"data.train_files: {len(data.train)} training rows do not fill one global batch of "
                           f"{global_batch} (micro_batch_size x gradient_accumulation_steps x {world} processes)")
    state = checkpoint.TrainerState(world_size=world, global_batch=global_batch, launch=backend.launch_kind(),
                                    data_fingerprint=data.train_fingerprint, recipe=run_folder.learning_relevant(recipe),
                                    layout=backend.checkpoint_layout(accelerator))
    if resume_from is not None:  # before any work: a checkpoint this launch cannot continue is refused now
        run_folder.check_resumable(checkpoint.read_state(resume_from), state, resume_from, recipe.resume_new_global_batch)
    collate = Collator(tokenizer.pad_token_id, packed=packing, padding_free=padding_free,
                       bounds=model_cfg.attn_implementation == "varlen")
    # Own generators: a DataLoader iterator otherwise draws its seed from the global RNG, so a resumed
    # run (which starts a fresh iterator mid-epoch) would leave dropout's random stream shifted.
    train_loader = DataLoader(data.train, batch_size=t.micro_batch_size, sampler=sampler, collate_fn=collate,
                              drop_last=True, generator=torch.Generator().manual_seed(recipe.seed),
                              pin_memory=accelerator.device.type == "cuda")
    # At most one rank's share of the eval rows: a larger batch is the same one forward, without padding to it.
    eval_batch = min(t.eval_batch_size or t.micro_batch_size, max(1, math.ceil(len(data.eval) / world)))
    eval_loader = DataLoader(data.eval, batch_size=eval_batch, collate_fn=collate,
                             sampler=EvalShardSampler(len(data.eval), eval_batch, accelerator.process_index, world),
                             generator=torch.Generator().manual_seed(recipe.seed))
    total_steps = t.max_steps or t.epochs * sampler.steps_per_epoch
    if t.warmup_steps > total_steps:  # max_steps was checked at load; epochs give their steps only now
        raise ToolkitError(f"train.warmup_steps: {t.warmup_steps} warmup steps exceed the {total_steps} optimizer steps "
                           f"that train.epochs={t.epochs} gives ({len(data.train)} rows / global batch {global_batch})")

    optimizer = backend.make_optimizer(accelerator, backend.param_groups(model, t.weight_decay), recipe)
    scheduler = backend.make_scheduler(accelerator, optimizer, warmup_cosine(t.warmup_steps, total_steps, t.min_lr_ratio),
                                       total_steps, t.warmup_steps)
    ds_config = backend.finalize_config(accelerator, model, recipe, total_steps)
    # The loop moves batches itself, after counting their tokens on the host (no device sync for counts).
    train_loader = accelerator.prepare_data_loader(train_loader, device_placement=False)
    faults.at("prepare")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    backend.check_prepared(accelerator, model)

    if resume_from is not None:
        state = run_folder.resume(accelerator, resume_from, state, model, optimizer, scheduler, recipe, len(data.train))
        sampler.resume_at(*state.data_position)
    summary = run_summary(recipe, accelerator, ds_config, rows=len(data.train), eval_rows=len(data.eval),
                          steps_per_epoch=sampler.steps_per_epoch, total_steps=total_steps)
    if accelerator.is_main_process:
        for line in summary:
            print(line if line.startswith("warning: ") else f"run: {line}", file=sys.stderr)
        with disk.writing("output_dir", out, remove=False, error=ToolkitError):
            removed = run_folder.record_launch(recipe, state, ds_config, resume_from, summary)
        if removed:
            log(f"overwrite: removed the earlier run's {', '.join(removed)} from {out}")
        if base_weights is not None:
            run_folder.save_preset_base(base_config, base_weights, tokenizer, out / "base-model")
    accelerator.wait_for_everyone()
    start_trackers(accelerator, recipe)  # after the overwrite: TensorBoard writes into output_dir
    watchdog = Watchdog(out, accelerator.process_index, world, accelerator.is_main_process, t.watchdog_seconds,
                        t.watchdog)
    speed = observe.Throughput(flops, observe.peak_tflops(t.precision, t.peak_tflops), world, total_steps, state.step)
    try:
        preemption.arm()  # from here a signal finishes the step and saves a checkpoint
        last = fit(accelerator, model, optimizer, scheduler, train_loader, eval_loader, recipe, state,
                   total_steps=total_steps, sampler=sampler, run_dir=out, preemption=preemption,
                   samples=samples, watchdog=watchdog, speed=speed)
    except TrainingStopped:
        preemption.disarm()
        end_trackers(accelerator)
        backend.teardown(accelerator)  # every rank agreed to stop at the same step
        raise
    # The run's result: a signal from here on waits for it (a second one more than 2 s later aborts).
    with preemption.deferred():
        preemption.disarm()
        if t.compile:  # the same count for a longer run: no step recompiled
            log(f"compile: {compiled_graphs()} graphs built")
        watchdog.begin("save", total_steps)
        base = None
        if recipe.lora.enabled and accelerator.is_main_process:  # which base the adapter belongs to
            folder = out / "base-model" if recipe.model.preset else resolve_model(recipe.model.path, recipe.model.revision)
            base = {base_identity.RECORD: base_identity.record(folder)}
        backend.save_model(accelerator, model, tokenizer, out / "final", extra_files=base)
        watchdog.done()
    log(f"saved {out / 'final'}")
    if preemption.requested:
        log(f"{preemption.signal_name} arrived after the last optimizer step; the run finished first: "
            f"{out / 'final'} is complete")
    end_trackers(accelerator)
    backend.teardown(accelerator)
    return last


def fit(accelerator, model, optimizer, scheduler, train_loader, eval_loader, recipe: Recipe,
        state: checkpoint.TrainerState, *, total_steps: int, sampler, run_dir: Path,
        preemption: Preemption, samples: Samples, watchdog: Watchdog, speed: observe.Throughput) -> dict:
    t = recipe.train
    metrics = MetricsLog(run_dir / "metrics.jsonl", accelerator)
    clock, first_step = observe.StepClock(accelerator.device), state.step + 1
    trace = observe.Trace(t.profile_steps, run_dir, accelerator.process_index, accelerator.device)
    outside = {"eval": 0.0, "checkpoints": 0.0}  # seconds spent outside steps, for the step profile
    rank, world = accelerator.process_index, accelerator.num_processes
    batches = global_batches(train_loader, sampler, t.gradient_accumulation_steps)
    per_epoch = sampler.steps_per_epoch * sampler.global_batch  # samples an epoch trains on
    clip = t.max_grad_norm if t.max_grad_norm > 0 else math.inf  # inf: no clipping, norm still measured
    nan_steps = injected_nonfinite_steps()
    row = {}
    if state.step == 0:
        row = {"step": 0, "epoch": 0.0, "eval_loss": evaluate(accelerator, model, eval_loader, watchdog, 0)}
        if row["eval_loss"] is not None:
            say(accelerator, f"step 0 | eval_loss {row['eval_loss']:.4f}")
        if samples:
            row["samples"] = show_samples(accelerator, samples(model), "step 0")
        metrics.write(row)
    progress = tqdm(total=total_steps, initial=state.step, disable=not accelerator.is_main_process,
                    dynamic_ncols=True, desc="training",
                    mininterval=0.5 if sys.stderr.isatty() else 30)  # logs that are files get few updates

    model.train()
    try:
        for step in range(state.step + 1, total_steps + 1):
            watchdog.begin("step", step)
            clock.start(step, first_step)
            trace.before(step)
            watchdog.at("data", step)
            epoch, seen, micro_batches = next(batches)
            # Exact accumulation: every target token of the global batch (all micro-batches, all ranks)
            # weighs the same, so the loss is a sum divided by the global count of target tokens.
            # Counted on the host, before the batches move: no device synchronisation for it.
            local = torch.tensor(host_counts(micro_batches), dtype=torch.float64)
            micro_batches = [to_device(b, accelerator.device) for b in micro_batches]
            clock.lap("data")
            watchdog.at("counts", step)
            n_targets, n_tokens, squared_lengths = map(int, accelerator.reduce(local.to(accelerator.device), "sum").tolist())
            clock.lap("sync")
            # The backends average gradients over ranks and accelerate divides by the accumulation
            # steps; this factor undoes both so the gradient is sum(token losses) / n_targets.
            scale = accelerator.num_processes * t.gradient_accumulation_steps / n_targets
            loss_sum = torch.zeros((), device=accelerator.device)
            lr = optimizer.param_groups[0]["lr"]  # this step's (a DeepSpeed scheduler steps inside the last backward)
            try:
                for i, batch in enumerate(micro_batches):
                    with accelerator.accumulate(model):
                        watchdog.at("forward", step, i)
                        injected_hang(step, i, rank)
                        if step == 2 and i == 0:
                            faults.at("step")
                        token_losses = token_loss_sum(model, batch)
                        if step in nan_steps and i == 0:  # test seam: a non-finite loss and gradient
                            token_losses = token_losses * float("nan")
                        clock.lap("forward")
                        watchdog.at("backward", step, i)
                        accelerator.backward(token_losses * scale)
                        loss_sum += token_losses.detach()
                        clock.lap("backward")
                        if accelerator.sync_gradients:  # the last micro-batch of this optimizer step
                            watchdog.at("optimizer", step)
                            grad_norm = as_float(accelerator.clip_grad_norm_(model.parameters(), clip))
                            applied = backend.optimizer_step(accelerator, model, optimizer, grad_norm)
                            if applied:  # a skipped step does not advance the schedule
                                scheduler.step()
                            optimizer.zero_grad(set_to_none=True)
                            clock.lap("optimizer")
            except Exception as e:
                reason = backend.step_failure(e)
                if reason is None:
                    raise
                kept = checkpoint.complete_checkpoints(run_dir)
                raise TrainingStopped(f"train: {reason} at step {step}; stopped. Last good checkpoint: "
                                      f"{kept[-1] if kept else 'none'}", EXIT_NONFINITE) from None

            # One reduction for the loss, "a rank was asked to stop" (so all ranks agree) and each
            # rank's peak memory (in its own slot).
            watchdog.at("sync", step)
            flags = torch.zeros(1 + world, dtype=torch.float64)
            flags[0], flags[1 + rank] = float(preemption.requested), observe.peak_memory_gib(accelerator.device)
            totals = accelerator.reduce(torch.cat([loss_sum.double().reshape(1), flags.to(accelerator.device)]),
                                        reduction="sum").tolist()
            loss, stop_requested, peaks = totals[0] / n_targets, totals[1] > 0, totals[2:]
            clock.lap("sync")
            scale_now = backend.loss_scale(accelerator, model)
            state.step, state.tokens_seen, state.data_position = step, state.tokens_seen + n_tokens, [epoch, seen]
            state.skipped_steps += not applied
            diverging = counts_toward_stop(loss, grad_norm, scale_now, applied)
            state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if diverging else 0
            elapsed = clock.end()
            watchdog.done()
            row = {"step": step, "epoch": round(epoch + seen / per_epoch, 4),
                   "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": state.tokens_seen,
                   **speed.row(step, elapsed, tokens=n_tokens, targets=n_targets, rows=sampler.global_batch,
                               squared_lengths=squared_lengths, peaks_gib=peaks),
                   "skipped_steps": state.skipped_steps, "loss_scale": scale_now, "time": round(time.time(), 3)}
            if line := trace.after(step):
                say(accelerator, line)
            if step % t.log_every_steps == 0 or step == total_steps:
                say(accelerator, f"step {step}/{total_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                                 f"grad_norm {grad_norm:.3f} | {speed_text(row)}")
            if state.nonfinite_in_a_row >= t.max_nonfinite_steps:
                metrics.write(row)
                kept = checkpoint.complete_checkpoints(run_dir)
                raise TrainingStopped(
                    f"train: loss or gradient not finite for {state.nonfinite_in_a_row} optimizer steps in a row "
                    f"(steps {step - state.nonfinite_in_a_row + 1}-{step}, none applied); stopped. Last good checkpoint: "
                    f"{kept[-1] if kept else 'none'}", EXIT_NONFINITE)
            if (t.eval_every_steps and step % t.eval_every_steps == 0) or step == total_steps:
                began = time.perf_counter()
                row["eval_loss"] = evaluate(accelerator, model, eval_loader, watchdog, step)
                if row["eval_loss"] is not None:
                    say(accelerator, f"step {step}/{total_steps} | eval_loss {row['eval_loss']:.4f}")
                if samples:
                    row["samples"] = show_samples(accelerator, samples(model), f"step {step}/{total_steps}")
                outside["eval"] += time.perf_counter() - began
            metrics.write(row)
            progress.set_postfix_str(f"loss {loss:.4f} | {speed_text(row, short=True)}", refresh=False)
            progress.update(1)
            every = recipe.checkpoint.every_steps
            if (every and (step % every == 0 or step == total_steps)) or stop_requested:
                path = checkpoint.checkpoint_dir(run_dir) / f"step-{step:06d}"
                watchdog.begin("checkpoint", step)
                took = checkpoint.save(accelerator, path, state, recipe.checkpoint, model, optimizer, scheduler)
                watchdog.done()
                outside["checkpoints"] += took["total"]
                say(accelerator, f"checkpoint {path.name} in {took.pop('total'):.2f} s ("
                                 + ", ".join(f"{part} {s:.2f} s" for part, s in took.items()) + ")")
                if stop_requested:
                    raise TrainingStopped(f"preempted: checkpoint {path} saved at step {step}; "
                                          "run again with resume=auto to continue", EXIT_PREEMPTED)
    finally:
        progress.close()  # before any stop message, so the bar does not trail it
    line, profile = observe.profile_report(clock, outside, recipe.model.gradient_checkpointing)
    say(accelerator, line)
    if accelerator.is_main_process and profile:
        observe.write_profile(run_dir, profile)
    return row


@torch.no_grad()
def evaluate(accelerator, model, eval_loader, watchdog: Watchdog | None = None, step: int = 0) -> float | None:
    """Token-weighted mean loss over the whole eval set (each rank holds a disjoint share)."""
    if len(eval_loader.dataset) == 0:
        return None
    if watchdog is not None:
        watchdog.begin("eval", step)
        watchdog.at("eval", step)
    if step > 0:
        faults.at("eval")
    model.eval()
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in eval_loader:
        batch = to_device(batch, accelerator.device)
        totals[0] += token_loss_sum(model, batch).double()
        totals[1] += (batch["labels"][:, 1:] != IGNORE).sum()
    model.train()
    totals = accelerator.reduce(totals, reduction="sum")
    if watchdog is not None:
        watchdog.done()
    return (totals[0] / totals[1]).item()


def global_batches(loader, sampler, accumulation: int):
    """Yield (epoch, samples of that epoch seen after this step, the micro-batches of one optimizer
    step), epoch after epoch, from the sampler's resume position."""
    epoch = sampler.resume_epoch
    while True:
        loader.set_epoch(epoch)
        it = iter(loader)
        start = sampler.resume_offset if epoch == sampler.resume_epoch else 0
        for i in range(sampler.steps_in(epoch)):
            yield epoch, start + (i + 1) * sampler.global_batch, [next(it) for _ in range(accumulation)]
        epoch += 1


def host_counts(micro_batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """Target tokens, processed tokens (packed rows carry no mask, so their little padding counts
    too) and the sum of squared document lengths (attention's FLOPs) of one step's host batches."""
    targets = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro_batches)
    tokens = sum(int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
                 for b in micro_batches)
    squared = sum(int(observe.document_lengths(b).pow(2).sum()) for b in micro_batches)
    return [targets, tokens, squared]


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


def start_trackers(accelerator, recipe: Recipe) -> None:
    """train.report_to: TensorBoard / W&B through accelerate, the recipe as hyperparameters."""
    if recipe.train.report_to:
        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
                for k, v in run_folder.flat_recipe(recipe).items()}
        accelerator.init_trackers(Path(recipe.output_dir).resolve().name, config=flat)


def show_samples(accelerator, answered: list[dict], where: str) -> list[dict]:
    for s in answered:
        say(accelerator, f"{where} | sample {s['prompt']!r} -> {s['answer']!r}")
    return answered


def say(accelerator, line: str) -> None:
    """A log line from the main process that does not break the progress bar."""
    if accelerator.is_main_process:
        tqdm.write(line)


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """LR multiplier for the i-th optimizer step (i from 0): linear warmup, then cosine decay."""

    def factor(i: int) -> float:
        if i < warmup_steps:
            return (i + 1) / warmup_steps
        progress = min(1.0, (i - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


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


def end_trackers(accelerator) -> None:
    """Flush and close the trackers (accelerate's end_training would also tear down the process group,
    which backend.teardown does in the order each backend needs)."""
    for tracker in accelerator.trackers:
        tracker.finish()


def injected_hang(step: int, micro: int, rank: int) -> None:
    """Test seam: TOOLKIT_FAULT_HANG=RANK:STEP:SECONDS makes that rank sleep before the forward of
    that step's first micro-batch, as a rank stuck in its own work would."""
    import os

    raw = os.environ.get("TOOLKIT_FAULT_HANG")
    if raw and micro == 0:
        r, s, seconds = raw.split(":")
        if int(r) == rank and int(s) == step:
            time.sleep(float(seconds))


def injected_nonfinite_steps() -> set[int]:
    """Test seam: TOOLKIT_FAULT_NONFINITE_STEPS=3,4 makes those optimizer steps' loss NaN on
    every rank, so the real skip / loss-scale / stop machinery runs on real NaN gradients."""
    import os

    raw = os.environ.get("TOOLKIT_FAULT_NONFINITE_STEPS", "")
    return {int(x) for x in raw.split(",") if x.strip()}


class MetricsLog:
    """metrics.jsonl: one JSON object per optimizer step (and the step-0 eval), main process only;
    the numbers also go to the trackers of train.report_to."""

    def __init__(self, path: Path, accelerator):
        self.path, self.accelerator, self.enabled = path, accelerator, accelerator.is_main_process

    def write(self, row: dict) -> dict:
        if self.enabled:
            with disk.writing("metrics", self.path, remove=False), open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if self.accelerator.trackers:
                scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                           and k not in ("step", "time")}
                scalars.update({f"peak_memory_gib/rank{i}": v for i, v in enumerate(row.get("peak_memory_gib", []))})
                self.accelerator.log(scalars, step=row["step"])
        return row
