"""The training loop: build everything from the recipe, let Accelerate prepare it, train, save.

`run()` builds; `fit()` is the loop and takes every object it uses as an argument. Neither names
a backend: the launch config decides DDP, FSDP or DeepSpeed, and `backend.py` holds what differs.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from . import backend
from .config import Recipe, ToolkitError, dump_recipe
from .data import IGNORE, Collator, EpochSampler, EvalRows, EvalShardSampler, build_datasets, packing_is_isolated
from .model import apply_lora, build_model, build_tokenizer, count_parameters


def run(recipe: Recipe, source: str = "recipe") -> dict:
    """Train as the recipe says; returns the last metrics row."""
    from accelerate.utils import set_seed

    out = Path(recipe.output_dir)
    check_output_dir(out, recipe)
    accelerator = backend.make_accelerator(recipe, source)
    log = accelerator.print
    t = recipe.train

    set_seed(recipe.seed)  # same initial weights on every rank and every backend
    tokenizer = build_tokenizer(recipe.model)
    model = build_model(recipe.model)
    packing = recipe.data.packing
    if packing and not packing_is_isolated(model):
        log("warning: this model lets packed documents attend to each other; padding instead of packing")
        packing = False
    if recipe.lora.enabled:
        if recipe.model.preset is not None:
            # A preset has no folder of its own: save the base beside the run so the adapter in
            # final/ loads with plain peft (its adapter_config.json points here).
            if accelerator.is_main_process:
                model.save_pretrained(out / "base-model")
                tokenizer.save_pretrained(out / "base-model")
        model = apply_lora(model, recipe.lora)
        if recipe.model.preset is not None:
            model.peft_config["default"].base_model_name_or_path = str((out / "base-model").resolve())
    trainable, total = count_parameters(model)
    log(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)")

    data = main_process_first(accelerator, lambda: build_datasets(recipe.data, tokenizer, recipe.seed, packing))
    world = accelerator.num_processes
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * world
    sampler = EpochSampler(len(data.train), global_batch, recipe.seed)
    if sampler.steps_per_epoch == 0:
        raise ToolkitError(f"data.train_files: {len(data.train)} training rows do not fill one global batch of "
                           f"{global_batch} (micro_batch_size x gradient_accumulation_steps x {world} processes)")
    collate = Collator(tokenizer.pad_token_id)
    train_loader = DataLoader(data.train, batch_size=t.micro_batch_size, sampler=sampler, collate_fn=collate,
                              drop_last=True)
    eval_batch = t.eval_batch_size or t.micro_batch_size
    eval_loader = DataLoader(EvalRows(data.eval), batch_size=eval_batch, collate_fn=collate,
                             sampler=EvalShardSampler(len(data.eval), eval_batch, accelerator.process_index, world))
    total_steps = t.max_steps or t.epochs * sampler.steps_per_epoch

    optimizer = backend.make_optimizer(accelerator, param_groups(model, t.weight_decay), recipe)
    scheduler = backend.make_scheduler(accelerator, optimizer, warmup_cosine(t.warmup_steps, total_steps, t.min_lr_ratio),
                                       total_steps, t.warmup_steps)
    backend.finalize_config(accelerator, model, recipe, total_steps)
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    backend.check_prepared(accelerator, model)

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(dump_recipe(recipe))
    log(f"training: {len(data.train):,} rows, {len(data.eval):,} eval rows, {total_steps} steps of "
        f"{global_batch} sequences ({world} process{'es' if world > 1 else ''}, {accelerator.distributed_type.value})")
    last = fit(accelerator, model, optimizer, scheduler, train_loader, eval_loader, recipe,
               total_steps=total_steps, steps_per_epoch=sampler.steps_per_epoch, metrics_path=out / "metrics.jsonl")
    backend.save_model(accelerator, model, tokenizer, out / "final")
    log(f"saved {out / 'final'}")
    backend.teardown(accelerator)
    return last


def fit(accelerator, model, optimizer, scheduler, train_loader, eval_loader, recipe: Recipe, *,
        total_steps: int, steps_per_epoch: int, metrics_path: Path) -> dict:
    t = recipe.train
    metrics = MetricsLog(metrics_path, accelerator.is_main_process)
    batches = global_batches(train_loader, steps_per_epoch, t.gradient_accumulation_steps)
    clip = t.max_grad_norm if t.max_grad_norm > 0 else math.inf  # inf: no clipping, norm still measured
    tokens_seen = 0
    row = metrics.write({"step": 0, "epoch": 0.0, "eval_loss": evaluate(accelerator, model, eval_loader)})
    if row["eval_loss"] is not None:
        say(accelerator, f"step 0 | eval_loss {row['eval_loss']:.4f}")
    progress = tqdm(total=total_steps, disable=not accelerator.is_main_process, dynamic_ncols=True, desc="training",
                    mininterval=0.5 if sys.stderr.isatty() else 30)  # logs that are files get few updates

    model.train()
    for step in range(1, total_steps + 1):
        started = time.perf_counter()
        epoch, micro_batches = next(batches)
        micro_batches = [{k: v.to(accelerator.device) for k, v in b.items()} for b in micro_batches]
        # Exact accumulation: every target token of the global batch (all micro-batches, all ranks)
        # weighs the same, so the loss is a sum divided by the global count of target tokens.
        local = torch.tensor([sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in micro_batches),
                              sum(int(count_input_tokens(b)) for b in micro_batches)], device=accelerator.device)
        n_targets, n_tokens = accelerator.reduce(local, reduction="sum").tolist()
        # The backends average gradients over ranks and accelerate divides by the accumulation
        # steps; this factor undoes both so the gradient is sum(token losses) / n_targets.
        scale = accelerator.num_processes * t.gradient_accumulation_steps / n_targets
        loss_sum = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):
                token_losses = token_loss_sum(model, batch)
                accelerator.backward(token_losses * scale)
                loss_sum += token_losses.detach()
                if accelerator.sync_gradients:  # the last micro-batch of this optimizer step
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                    lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    if not backend.optimizer_step_was_skipped(accelerator, model):
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=True)

        loss = accelerator.reduce(loss_sum, reduction="sum").item() / n_targets
        tokens_seen += n_tokens
        elapsed = time.perf_counter() - started
        row = {"step": step, "epoch": round(epoch + ((step - 1) % steps_per_epoch + 1) / steps_per_epoch, 4),
               "loss": loss, "lr": lr, "grad_norm": as_float(grad_norm), "tokens": tokens_seen,
               "tokens_per_second": n_tokens / elapsed}
        if step % t.log_every_steps == 0 or step == total_steps:
            say(accelerator, f"step {step}/{total_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                             f"grad_norm {row['grad_norm']:.3f} | {row['tokens_per_second']:,.0f} tok/s")
        if (t.eval_every_steps and step % t.eval_every_steps == 0) or step == total_steps:
            row["eval_loss"] = evaluate(accelerator, model, eval_loader)
            if row["eval_loss"] is not None:
                say(accelerator, f"step {step}/{total_steps} | eval_loss {row['eval_loss']:.4f}")
        metrics.write(row)
        progress.set_postfix(loss=f"{loss:.4f}", refresh=False)
        progress.update(1)
    progress.close()
    return row


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropies over the batch's target tokens."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")


@torch.no_grad()
def evaluate(accelerator, model, eval_loader) -> float | None:
    """Token-weighted mean loss over the whole eval set (each rank holds a disjoint share)."""
    if len(eval_loader.dataset) == 0:
        return None
    model.eval()
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for batch in eval_loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        totals[0] += token_loss_sum(model, batch).double()
        totals[1] += (batch["labels"][:, 1:] != IGNORE).sum()
    model.train()
    totals = accelerator.reduce(totals, reduction="sum")
    return (totals[0] / totals[1]).item()


def global_batches(loader, steps_per_epoch: int, accumulation: int):
    """Yield (epoch, the micro-batches of one optimizer step), epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        it = iter(loader)
        for _ in range(steps_per_epoch):
            yield epoch, [next(it) for _ in range(accumulation)]
        epoch += 1


def count_input_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens the model processed; packed rows carry no mask, so their little padding counts too."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel())


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


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only, never norms or biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # DeepSpeed fails on an empty group (LoRA has no 1-D params)


def as_float(x) -> float:
    if x is None:
        return float("nan")
    if hasattr(x, "full_tensor"):  # a DTensor from a sharded model
        x = x.full_tensor()
    return float(x)


def check_output_dir(out: Path, recipe: Recipe) -> None:
    """Refuse to write into earlier results unless asked; with overwrite, clear them first."""
    if out.exists() and not out.is_dir():
        raise ToolkitError(f"output_dir: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not recipe.overwrite:
            raise ToolkitError(f"output_dir: {out} is not empty; choose another folder or pass overwrite=true")
        if backend.is_main_rank():
            shutil.rmtree(out)


def main_process_first(accelerator, fn):
    """Run fn on the main process, then on the others (which read its caches). A user error on the
    main process still reaches the barrier, so the other ranks fail the same way instead of hanging."""
    error, result = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except ToolkitError as e:
            error = e
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        result = fn()
    if error is not None:
        raise error
    return result


class MetricsLog:
    """metrics.jsonl: one JSON object per optimizer step (and the step-0 eval), main process only."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, row: dict) -> dict:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row
