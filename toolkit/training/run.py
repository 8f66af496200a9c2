"""The training loop: build everything from the recipe, let Accelerate prepare it, train, save.

`build()` makes a `Run` (prepared model, optimizer, scheduler, loaders, state, objective, monitor);
`fit()` is the loop over `train_step()`, one optimizer step. None of them names a backend: the
launch config decides DDP, FSDP or DeepSpeed, and the run's backend object (`backends/`, chosen
once from the launch) holds what differs. The loss of a
batch comes from the objective (`objectives.py`); everything that watches the run without changing
what it learns sits behind the monitor (`monitor.py`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..model import activations, base_identity
from .. import backends, faults
from ..storage import checkpoint, disk, run_folder
from . import objectives, reference
from ..observe import measure
from ..config import Recipe
from ..errors import ToolkitError
from ..data.prepare import (Collator, EpochSampler, EvalShardSampler, build_datasets, label_audit, longest_row,
                            most_positions, packing_is_isolated, remove_partial_data)
from ..backends.sizing import count_model
from ..model.hub import is_hub_id, resolve_model
from .loss import use_token_loss
from ..model.load import (DTYPES, adapter_coverage, apply_lora, build_model, build_tokenizer, compile_layers,
                          compiled_graphs, config_overrides, count_parameters, fit_vocabulary, isolation_probe,
                          token_rows)
from ..observe.monitor import Monitor
from ..stops import EXIT_NONFINITE, EXIT_PREEMPTED, Preemption, TrainingStopped
from .samples import Samples
from .summary import run_summary
from ..observe.watchdog import Watchdog


def run(recipe: Recipe, source: str = "recipe", preemption: Preemption | None = None) -> dict:
    """Train as the recipe says; returns the last metrics row. `preemption`: the signal handler,
    installed by the CLI before the slow imports so that a signal at any moment gets its line.
    The run holds `output_dir`'s lock from the start to the end, whatever the end."""
    out = Path(recipe.output_dir)
    preemption = preemption or Preemption()
    backend = backends.for_launch()
    backend.make_accelerator(recipe, source)
    lock = run_folder.RunLock(out)
    try:
        return _run(backend, recipe, preemption, lock)
    finally:
        lock.release()  # also on a refusal: the folder is as it was (removed again if this run made it)


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
    objective: objectives.Supervised | objectives.Preference
    monitor: Monitor
    preemption: Preemption
    samples: Samples
    speed: measure.Throughput
    offload: Any  # the context each forward runs in (model.activation_offload)



def _run(backend: backends.Backend, recipe: Recipe, preemption: Preemption, lock: run_folder.RunLock) -> dict:
    accelerator = backend.accelerator
    run, tokenizer = build(backend, recipe, preemption, lock)
    try:
        preemption.arm()  # from here a signal finishes the step and saves a checkpoint
        last = fit(run)
        save_final(run, tokenizer)
    except TrainingStopped:  # every rank stops here together: at the same step, or a save that did not read back
        preemption.disarm()
        end_trackers(accelerator)
        # A stop skipping this left a gloo thread to die in a C++ destructor at exit: "terminate called
        # without an active exception", SIGABRT instead of the stop's code (ZeRO-3 save read-back, CI 2026-11-26)
        backend.teardown()
        raise
    end_trackers(accelerator)
    backend.teardown()
    return last


def build(backend: backends.Backend, recipe: Recipe, preemption: Preemption,
          lock: run_folder.RunLock) -> tuple[Run, Any]:
    """Everything the recipe asks for, checked and prepared, the run folder opened (or resumed):
    (the run, its tokenizer). Every check that can refuse the run comes before anything on disk
    changes; an earlier run that `overwrite` replaces is removed only at the end, just before step 1."""
    from accelerate.utils import set_seed

    accelerator = backend.accelerator
    out = Path(recipe.output_dir)
    log = accelerator.print
    t = recipe.train
    resume_from = run_folder.open_run(accelerator, recipe, lock)

    set_seed(recipe.seed)  # same initial weights on every rank and every backend
    tokenizer = build_tokenizer(recipe.model)
    samples = Samples(recipe, tokenizer, accelerator)  # train.sample_prompts rendered now: a bad one fails here
    model_cfg = recipe.model
    split = backend.sequence_parallel > 1  # each row split across that many ranks (sequence.py)
    if model_cfg.attn_implementation == "sdpa" and (recipe.data.padding_free or (split and recipe.data.packing)):
        # sdpa would build a dense mask over the micro-batch, and a split row's attention takes no mask
        model_cfg = dataclasses.replace(model_cfg, attn_implementation="varlen")
        log("attention: varlen (" + ("data.padding_free; sdpa would mask the whole micro-batch)" if not split else
                                     "packed documents split across ranks; sequence-parallel attention takes no mask)"))
    faults.at("model")
    model = build_model(model_cfg, DTYPES[recipe.model.dtype], DTYPES[recipe.train.precision])
    backend.check_model(model, recipe)
    if recipe.model.tiled_mlp:
        row = longest_row(recipe)
        tiles, mlps = activations.tile_mlps(model, row)
        log(f"tiled MLP: each of {mlps} MLPs runs as {tiles} tiles of at most {-(-row // tiles)} positions")
    added = fit_vocabulary(model, tokenizer, backend.full_shape)
    rows = token_rows(model, tokenizer, recipe.model.add_special_tokens, added, backend.full_shape)
    if recipe.model.add_special_tokens:
        log(f"vocabulary: {len(tokenizer)} tokens with model.add_special_tokens; "
            + (f"embeddings grown by {added} rows (mean-initialised, trained)" if added else
               "the model's spare embedding rows hold them")
            + (f"; with LoRA, {len(rows)} embedding rows train whole (peft trainable tokens)"
               if recipe.lora.enabled else ""))
    flops = measure.Flops.of(count_model(model.config, "model", recipe.lora), recipe.lora.enabled,
                             extra_forwards=int(recipe.preference.reference == "adapter"))
    use_token_loss(model, t.loss, t.loss_chunk_tokens, backend, most_positions(recipe))  # in the forward, where every backend has whole weights
    packing, padding_free = recipe.data.packing, recipe.data.padding_free
    if (packing or padding_free) and not packing_is_isolated(
            isolation_probe(model, backend.partitioned_before_prepare(model))):
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
        backend.check_adapter(bool(rows))
        # The adapter's first weights must not depend on what building drew: under ZeRO-3's
        # zero.Init on a GPU the load draws from the CUDA generator and the isolation probe builds a
        # small model, so the CPU generator stood elsewhere than in a plain run (H100, 2026-11-26:
        # lora_A 0.27 apart between one process and ZeRO-3).
        set_seed(recipe.seed)
        model = apply_lora(model, recipe.lora, rows)
        backend.adapted(model)
        if recipe.model.preset is not None:
            model.peft_config["default"].base_model_name_or_path = str((out / "base-model").resolve())
        elif not is_hub_id(recipe.model.path):  # absolute: the adapter loads from any working directory
            model.peft_config["default"].base_model_name_or_path = str(Path(recipe.model.path).resolve())
    objective = objectives.for_recipe(recipe, model)
    if getattr(objective, "router_aux_coef", 0):
        log(f"router: load-balancing loss x {objective.router_aux_coef:g} added to the training loss (aux_loss)")
    if t.compile:
        backend.check_compile(recipe)
        log(f"compile: {compile_layers(model)} decoder layers (the first steps compile them)")
    trainable, total = count_parameters(model)
    log(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")
    if recipe.lora.enabled:
        coverage, warning = adapter_coverage(model, backend.full_shape)
        log(f"lora: {coverage}")
        if warning:
            log(f"warning: {warning}")
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
    world, (_, ranks) = accelerator.num_processes, backend.data_parallel()  # ranks that see different rows
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * ranks
    sampler = EpochSampler(len(data.train), global_batch, recipe.seed)
    if sampler.steps_per_epoch == 0:
        raise ToolkitError(f"data.train_files: {len(data.train)} training rows do not fill one global batch of "
                           f"{global_batch} (micro_batch_size x gradient_accumulation_steps x {ranks} "
                           + ("processes)" if ranks == world else f"data-parallel ranks of {world} processes)"))
    state = checkpoint.TrainerState(world_size=world, global_batch=global_batch, launch=backend.kind,
                                    data_fingerprint=data.train_fingerprint, recipe=run_folder.learning_relevant(recipe),
                                    layout=backend.layout())
    if resume_from is not None:  # before any work: a checkpoint this launch cannot continue is refused now
        run_folder.check_resumable(checkpoint.read_state(resume_from), state, resume_from, recipe.resume_new_global_batch)
    collate = Collator(tokenizer.pad_token_id, packed=packing, padding_free=padding_free,
                       bounds=model_cfg.attn_implementation == "varlen", pairs=data.train.pairs,
                       multiple=backend.sequence_parallel)
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

    optimizer = backend.make_optimizer(backend.param_groups(model, t.weight_decay), recipe)
    scheduler = backend.make_scheduler(optimizer, warmup_cosine(t.warmup_steps, total_steps, t.min_lr_ratio),
                                       total_steps, t.warmup_steps)
    ds_config = backend.finalize_config(model, recipe, total_steps)
    # The loop moves batches itself, after counting their tokens on the host (no device sync for counts).
    train_loader = backend.prepare_train_loader(train_loader)
    faults.at("prepare")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    backend.check_prepared(model)
    if recipe.preference.method is not None:
        log(f"preference: {preference_line(recipe)}")
    if recipe.preference.reference == "precomputed":  # with the starting weights, before any resume loads others
        for line in reference.precompute(accelerator, model, {"train": data.train, "eval": data.eval}, data.folder,
                                         reference.weights_key(recipe), eval_batch, collate):
            log(f"reference: {line}")

    if resume_from is not None:
        state = run_folder.resume(backend, resume_from, state, model, optimizer, scheduler, recipe, len(data.train))
        sampler.resume_at(*state.data_position)
    summary = run_summary(recipe, backend, ds_config, rows=len(data.train), eval_rows=len(data.eval),
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
    monitor = Monitor(accelerator, out, watchdog, t.profile_steps, first_step=state.step + 1)
    speed = measure.Throughput(flops, measure.peak_tflops(t.precision, t.peak_tflops), world, total_steps, state.step)
    return Run(backend=backend, accelerator=accelerator, recipe=recipe, model=model, optimizer=optimizer, scheduler=scheduler,
               train_loader=train_loader, eval_loader=eval_loader, sampler=sampler, state=state,
               total_steps=total_steps, out=out, objective=objective, monitor=monitor, preemption=preemption,
               samples=samples, speed=speed, offload=activations.offload(recipe.model.activation_offload)), tokenizer


def preference_line(recipe: Recipe) -> str:
    """What the preference objective is and where DPO's reference comes from, for the start of the run."""
    p = recipe.preference
    knobs = [f"beta {p.beta:g}"] + ([f"loss_type {p.loss_type}"] if p.method == "dpo" else []) \
        + ([f"gamma {p.gamma:g}"] if p.method == "simpo" else []) \
        + ([f"label_smoothing {p.label_smoothing:g}"] if p.label_smoothing else [])
    where = {"adapter": "reference: the model with its LoRA adapter disabled (one more forward per micro-batch, "
                        "without gradient; no second model)",
             "precomputed": "reference: log-probabilities computed once with the starting weights, before step 1, "
                            "and kept beside the prepared data (no second model)"}
    return f"{p.method}, " + ", ".join(knobs) + (f"; {where[p.reference]}" if p.method == "dpo" else
                                                 "; no reference model") + "; the loss is a mean over pairs"


def save_final(run: Run, tokenizer) -> None:
    """The run's result, `final/`: a signal from here on waits for it (a second one more than 2 s
    later aborts)."""
    accelerator, recipe, out, preemption = run.accelerator, run.recipe, run.out, run.preemption
    with preemption.deferred():
        preemption.disarm()
        if recipe.train.compile:  # the same count for a longer run: no step recompiled
            accelerator.print(f"compile: {compiled_graphs()} graphs built")
        run.monitor.watchdog.begin("save", run.total_steps)
        base = None
        if recipe.lora.enabled and accelerator.is_main_process:  # which base the adapter belongs to
            folder = out / "base-model" if recipe.model.preset else resolve_model(recipe.model.path, recipe.model.revision)
            base = {base_identity.RECORD: base_identity.record(folder, config_overrides(recipe.model))}
        run.backend.save_model(run.model, tokenizer, out / "final", extra_files=base)
        run.monitor.watchdog.done()
    accelerator.print(f"saved {out / 'final'}")
    if preemption.requested:
        accelerator.print(f"{preemption.signal_name} arrived after the last optimizer step; the run finished first: "
                          f"{out / 'final'} is complete")


def fit(run: Run) -> dict:
    """Train from `run.state.step` to `run.total_steps`; returns the last metrics row."""
    acc, t, state, monitor = run.accelerator, run.recipe.train, run.state, run.monitor
    batches = global_batches(run.train_loader, run.sampler, t.gradient_accumulation_steps)
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
                    f"(steps {step - state.nonfinite_in_a_row + 1}-{step}, none applied); stopped. Last good checkpoint: "
                    f"{last_checkpoint(run.out)}", EXIT_NONFINITE)
            if (t.eval_every_steps and step % t.eval_every_steps == 0) or step == run.total_steps:
                row.update(evaluation(run, step))
            monitor.metrics.write(row)
            progress.set_postfix_str(f"loss {row['loss']:.4f} | {speed_text(row, short=True)}", refresh=False)
            progress.update(1)
            every = run.recipe.checkpoint.every_steps
            if (every and (step % every == 0 or step == run.total_steps)) or stop_requested:
                path = save_checkpoint(run, step)
                if stop_requested:
                    raise TrainingStopped(f"preempted: checkpoint {path} saved at step {step}; "
                                          "run again with resume=auto to continue", EXIT_PREEMPTED)
    finally:
        progress.close()  # before any stop message, so the bar does not trail it
    line, profile = monitor.profile_report(run.recipe.model.gradient_checkpointing)
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
        # Exact accumulation: every unit of the global batch (all micro-batches, all ranks) weighs
        # the same, so the loss is a sum divided by the global count of units. Counted on the
        # host, before the batches move: no device synchronisation for it.
        local = torch.tensor(run.objective.host_counts(micro_batches), dtype=torch.float64)
        # Where rows are split across ranks, each rank keeps its part (and counted the whole rows).
        micro_batches = [to_device(run.backend.shard_sequence(b), acc.device) for b in micro_batches]
    with monitor.phase("counts", step, lap="sync"):
        split = run.backend.sequence_parallel
        n_units, n_tokens, squared_lengths = (int(x) // split for x in acc.reduce(local.to(acc.device), "sum").tolist())
    # The backends divide the gradients summed over ranks by `gradient_average()` ranks and
    # accelerate divides by the accumulation steps; this factor undoes both so the gradient is
    # sum(unit losses) / n_units.
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
        loss, *extra_sums = (x / n_units for x in totals[:len(sums)])
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
           "loss": loss, **dict(zip(extra, extra_sums)), "lr": lr, "grad_norm": grad_norm, "tokens": state.tokens_seen,
           **run.speed.row(step, elapsed, tokens=n_tokens, targets=n_units, rows=run.sampler.global_batch,
                           squared_lengths=squared_lengths, peaks_gib=peaks),
           "skipped_steps": state.skipped_steps, "loss_scale": scale_now, "time": round(time.time(), 3)}
    if run.recipe.train.compile:  # a count that still rises after the first steps means recompiling
        row["compiled_graphs"] = compiled_graphs()
    return row, stop_requested


def evaluation(run: Run, step: int) -> dict:
    """The eval loss (and the samples of train.sample_prompts) at `step`, said and returned as metrics."""
    where = "step 0" if step == 0 else f"step {step}/{run.total_steps}"
    found = {}
    with run.monitor.outside_steps("eval", step, "eval"):
        found.update(evaluate(run.accelerator, run.model, run.eval_loader, run.objective, run.monitor, step))
        if found["eval_loss"] is not None:
            say(run.accelerator, f"{where} | " + " | ".join(f"{k} {v:.4f}" for k, v in found.items()))
        if run.samples:
            found["samples"] = show_samples(run.accelerator, run.samples(run.model), where)
    return found


def save_checkpoint(run: Run, step: int) -> Path:
    path = checkpoint.checkpoint_dir(run.out) / f"step-{step:06d}"
    run.monitor.watchdog.begin("checkpoint", step)
    took = checkpoint.save(run.backend, path, run.state, run.recipe.checkpoint, run.model, run.optimizer,
                           run.scheduler)
    run.monitor.watchdog.done()
    run.monitor.outside["checkpoints"] += took["total"]
    say(run.accelerator, f"checkpoint {path.name} in {took.pop('total'):.2f} s ("
                         + ", ".join(f"{part} {s:.2f} s" for part, s in took.items()) + ")")
    return path


def last_checkpoint(out: Path) -> str:
    kept = checkpoint.complete_checkpoints(out)
    return str(kept[-1]) if kept else "none"


@torch.no_grad()
def evaluate(accelerator, model, eval_loader, objective, monitor: Monitor | None = None, step: int = 0) -> dict:
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
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in eval_loader:
        batch = to_device(batch, accelerator.device)
        totals[0] += objective.loss_sum(model, batch).double()
        totals[1] += objective.units(batch)
    model.train()
    extra = {k: v for k, v in objective.step_metrics(accelerator.device).items()
             if k in getattr(objective, "metrics", ())}  # the per-pair rewards; not the router's training-only loss
    totals = accelerator.reduce(torch.cat([totals, *(v.reshape(1) for v in extra.values())]), reduction="sum")
    n = totals[1]
    return {"eval_loss": (totals[0] / n).item(), **{f"eval_{k}": (v / n).item() for k, v in zip(extra, totals[2:])}}


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
    which the backend's teardown does in the order each backend needs)."""
    for tracker in accelerator.trackers:
        tracker.finish()
