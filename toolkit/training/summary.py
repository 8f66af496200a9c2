"""The start-of-run summary: which backend, precision, batch arithmetic, optimizer and schedule are
in force, which of them a DeepSpeed JSON decided rather than the recipe, and the memory estimate of
`toolkit estimate` for this launch. Printed as `run:` lines by the main process and kept in the
manifest; a line starting with `warning: ` (the estimate does not fit the GPU) is printed as it is."""

from __future__ import annotations

from pathlib import Path

from ..backends import deepspeed_config
from ..backends.run_sizing import estimate_for_run
from ..config import Recipe
from ..config.methods import method_of
from ..optim import optimizers, schedules


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
    if accelerator.device.type == "cpu":
        precision += cpu_precision_cost(t.precision)
    lines.append(precision)

    ranks = backend.data_parallel()[1]
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * ranks
    length = "train.max_steps" if t.max_steps else f"train.epochs {t.epochs}"
    method = method_of(recipe)
    unit = method.unit
    if method.online:  # micro_batch_size counts prompts; each is trained on with its num_generations completions
        g = recipe.rl.num_generations
        unit = f"prompts x {g} completions ({global_batch * g} sequences of prompt + completion)"
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
        # the toolkit's default learning rate is made for SFT: a run left at it hears its own trainer's in TRL
        trl = (method.trl, method.trl_learning_rate) if method.trl_learning_rate else None
        default_lr = trl is not None and t.learning_rate == type(t)().learning_rate
        adam = t.optim.startswith(("adamw", "paged_adamw"))
        lines.append(f"optimizer {t.optim} ({optimizers.OPTIMIZERS[t.optim].what}) lr {t.learning_rate:g}"
                     + (f", betas ({t.adam_beta1:g}, {t.adam_beta2:g}), eps {t.adam_epsilon:g}" if adam else "")
                     + f", weight_decay {t.weight_decay:g} on matrices only"
                     + "".join(f", {k} {v}" for k, v in t.optim_args.items()) + " (recipe)"
                     + (f"; LoRA+: B matrices and 1-D parameters at lr x {recipe.lora.loraplus_lr_ratio:g}"
                        if recipe.lora.enabled and recipe.lora.loraplus_lr_ratio else "")
                     + (f"; embeddings at lr {t.embedding_learning_rate:g}" if t.embedding_learning_rate else "")
                     + (f"; that lr is the default, made for SFT: TRL's {trl[0]} default is {trl[1]} (full "
                        "fine-tuning); set train.learning_rate" if default_lr else ""))
    if "scheduler" in ds:
        lines.append(f"schedule {ds['scheduler'].get('type')} from {json_name}: {_params(ds['scheduler'])}; "
                     "the recipe's train.lr_scheduler_type and min_lr_ratio are not used")
    else:
        lines.append(schedules.describe(t, total_steps))
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


# The CPU flags (Linux /proc/cpuinfo: x86 `flags`, Arm `Features`) that compute each half precision
# natively; without them PyTorch converts to fp32 and back around the work, or runs slow reference
# kernels.
NATIVE = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}


def cpu_precision_cost(precision: str, flags: set[str] | None = None) -> str:
    """What bf16 or fp16 costs on a CPU host, as a clause for the precision line ('' for fp32): said
    at the start, since a bf16 run on a CPU without the instructions ran 3x and more slower than fp32
    and nothing said why (issue 45). The recipe's choice stands: tests train bf16 on a CPU on purpose."""
    if precision == "fp32":
        return ""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return f"; on a CPU host {precision} is emulated by most CPUs and slower than fp32, which trains fastest there"
    native = [flag for flag in NATIVE[precision] if flag in flags]
    if native:
        return (f"; this CPU computes {precision} natively ({native[0]}): about as fast as fp32 (slower on the "
                "smallest models)")
    return (f"; emulated on this CPU (no {' or '.join(NATIVE[precision][:2])} instructions): slower than fp32, "
            "several times on most CPUs; train.precision=fp32 trains fastest here")


def cpu_flags() -> set[str]:
    """This CPU's feature flags, empty where the system does not say (no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _params(section: dict) -> str:
    params = section.get("params", {})
    return ", ".join(f"{k} {v}" for k, v in params.items()) or "no parameters"
