"""The start-of-run summary: which backend, precision, batch arithmetic, optimizer and schedule are
in force, which of them a DeepSpeed JSON decided rather than the recipe, and the memory estimate of
`toolkit estimate` for this launch. Printed as `run:` lines by the main process and kept in the
manifest; a line starting with `warning: ` (the estimate does not fit the GPU) is printed as it is."""

from __future__ import annotations

from ..backends import deepspeed_config
from ..backends.sizing import estimate_for_run
from ..config import Recipe


def run_summary(recipe: Recipe, backend, ds_config: dict | None, *, rows: int, eval_rows: int,
                steps_per_epoch: int, total_steps: int) -> list[str]:
    accelerator = backend.accelerator
    t, world = recipe.train, accelerator.num_processes
    ds = ds_config or {}
    json_name = deepspeed_config.config_source() or "the accelerate config's deepspeed_config"
    lines = [f"backend {backend.describe()}"]

    precision = f"precision {t.precision} (train.precision)"
    if recipe.lora.enabled and recipe.model.dtype != "fp32":
        precision += f"; frozen base weights stored in {recipe.model.dtype}"
    if t.precision == "fp16":
        precision += f"; dynamic loss scale from {t.initial_loss_scale:g}"
    lines.append(precision)

    ranks = backend.data_parallel()[1]
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * ranks
    length = "train.max_steps" if t.max_steps else f"train.epochs {t.epochs}"
    unit = "preference pairs" if recipe.preference.method else "sequences"
    split = backend.sequence_parallel
    by = (f"{world} process{'es' if world > 1 else ''}" if split == 1 else
          f"{ranks} data-parallel rank{'s' if ranks > 1 else ''} ({world} processes, each sequence split across "
          f"{split})")
    lines.append(f"batch {global_batch} {unit} per optimizer step = micro_batch_size {t.micro_batch_size} x "
                 f"gradient_accumulation_steps {t.gradient_accumulation_steps} x {by}; {rows:,} rows give "
                 f"{steps_per_epoch} steps per epoch; {total_steps} steps ({length}); {eval_rows:,} eval rows")

    if "optimizer" in ds:
        lines.append(f"optimizer {ds['optimizer'].get('type')} from {json_name}: {_params(ds['optimizer'])}")
    else:
        lines.append(f"optimizer AdamW lr {t.learning_rate:g}, betas ({t.adam_beta1:g}, {t.adam_beta2:g}), "
                     f"eps {t.adam_epsilon:g}, weight_decay {t.weight_decay:g} on matrices only (recipe)")
    if "scheduler" in ds:
        lines.append(f"schedule {ds['scheduler'].get('type')} from {json_name}: {_params(ds['scheduler'])}; "
                     "the recipe's warmup-cosine and min_lr_ratio are not used")
    else:
        lines.append(f"schedule linear warmup over {t.warmup_steps} step{'s' if t.warmup_steps != 1 else ''}, "
                     f"then cosine decay to {t.min_lr_ratio:g} x learning_rate at step {total_steps} (recipe)")
    lines.append(f"gradient clipping at global norm {t.max_grad_norm:g} (train.max_grad_norm)" if t.max_grad_norm > 0
                 else "gradient clipping off (train.max_grad_norm 0); the norm is still logged")
    memory = [what for on, what in ((recipe.model.gradient_checkpointing, "gradient checkpointing"),
                                    (recipe.model.tiled_mlp, "tiled MLP (tiles of hidden_size positions)"),
                                    (recipe.model.activation_offload, "saved activations in host memory"))
              if on]
    if memory:
        lines.append(f"activations: {', '.join(memory)}")
    try:  # advice only: an architecture the arithmetic does not know must not stop a run
        line, warning = estimate_for_run(recipe, accelerator, ds_config)
    except Exception as e:
        line, warning = f"estimate unavailable: {(str(e).splitlines() or [type(e).__name__])[0]}", None
    lines += [line] + ([f"warning: {warning}"] if warning else [])
    return lines


def _params(section: dict) -> str:
    params = section.get("params", {})
    return ", ".join(f"{k} {v}" for k, v in params.items()) or "no parameters"
