"""DeepSpeed configs as users bring them: resolve every "auto" from the recipe, map legacy
spellings, refuse contradictions, keys DeepSpeed does not read (a typo it would ignore) and what
this toolkit cannot run, each in one line. TOP_LEVEL_KEYS says what happens to every key it reads.

The recipe is the single source of truth for batch sizes, accumulation, clipping, precision and
the optimizer's hyper-parameters. A DeepSpeed JSON written for the Hugging Face Trainer ("auto"
almost everywhere) is filled in from it; a fixed value that disagrees with the recipe stops the
run before training, naming the file, the key and both values. What the JSON decides for itself
(its optimizer type, its scheduler) is kept, and `notes` says so. The result is checked against
DeepSpeed's own schema here, so a key DeepSpeed rejects is one line, not a traceback per rank.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
from pathlib import Path
from typing import Any

from ..config import Recipe
from ..errors import ToolkitError
from ..optim import optimizers

# zero_optimization spellings: deprecated or alternative name -> the one this module writes.
# DeepSpeed's schema accepts a field under its name or its alias but fails when both appear.
ZERO_SPELLINGS = {
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
LOSS_SCALING_KEYS = {"loss_scale", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                     "initial_scale_power"}
# Legacy boolean switches that became offload sections.
ZERO_OFFLOAD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}

# Every top-level key DeepSpeed 0.19.8 reads, and what this toolkit does with it. Read from
# deepspeed/runtime/config.py (DeepSpeedConfig.__init__, _initialize_params, the get_* it calls and
# _REMOVED_TOP_LEVEL_CONFIG_KEYS) and the section parsers it hands param_dict to: zero/config.py,
# precision_config.py, activation_checkpointing/config.py, comm/config.py, monitor/config.py,
# profiling/config.py, autotuning/config.py, datastates/config.py, swap_tensor/aio_config.py,
# model_checkpointing/config.py, tensor_parallel, data_pipeline/config.py, utils/config.py (timers),
# module_inject/auto_ep_config.py. tests/test_deepspeed_config.py asks DeepSpeed's parser which keys it
# looks up and compares, so a DeepSpeed that reads another key fails there. Any other key is refused
# with a "did you mean" (DeepSpeed would ignore it: a typo trains without what it asked for).
#   recipe:    settled from the recipe, rewritten or noted by resolve()
#   deepspeed: passed through; the engine does under this loop what DeepSpeed means by it
#   refused:   refused where it asks for what this loop cannot honour (REFUSALS says when and why);
#              off, it is passed through and DeepSpeed does nothing with it
#   removed:   removed in DeepSpeed 0.19; DeepSpeed refuses it itself (validate())
TOP_LEVEL_KEYS = {
    **dict.fromkeys(["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer", "scheduler", "zero_optimization",
                     "steps_per_print"], "recipe"),
    **dict.fromkeys(["communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
                     "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
                     "wall_clock_breakdown", "memory_breakdown", "flops_profiler", "tensorboard", "wandb",
                     "csv_monitor", "comet", "timers", "log_level", "dump_state", "disable_python_gc",
                     "disable_allgather", "vocabulary_size", "aio", "data_types"], "deepspeed"),
    **dict.fromkeys(["tensor_parallel", "sequence_parallel_size", "pipeline", "expert_parallel",
                     "use_data_before_expert_parallelism", "hybrid_engine", "autotuning", "data_efficiency",
                     "dataloader_drop_last", "activation_checkpointing", "torch_autocast",
                     "managed_gradient_accumulation", "gradient_allreduce_op", "weight_quantization",
                     "datastates_ckpt", "checkpoint", "compile", "comms_logger"], "refused"),
    **dict.fromkeys(["amp", "compression_training", "curriculum_learning", "eigenvalue", "elasticity",
                     "graph_harvesting", "nebula", "progressive_layer_drop", "quantize_training", "sparse_attention",
                     "sparse_gradients"], "removed"),
}
# A near miss of one of these is refused: DeepSpeed would train without what it asks for (batch, precision,
# clipping, optimizer, schedule, ZeRO and its offload, communication precision, activation checkpointing).
MATTERS = {key for key, use in TOP_LEVEL_KEYS.items() if use == "recipe"} | {
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "aio", "data_types",
    "activation_checkpointing", "torch_autocast"}
# Sections other projects name differently (LLaMA-Factory's ds_z3_fp8_config.json, tests/config_corpus).
PEER_KEYS = {"comms_config": "comms_logger", "monitor_config": "tensorboard, wandb, csv_monitor or comet (each a "
             "top-level section)"}


def _turns_on(*fields: str):
    """A section that turns on one of `fields` (any of its fields when none are named): `.field is value`."""
    def asks(node: Any) -> str | None:
        if isinstance(node, dict):
            for field in fields or list(node):
                if node.get(field) not in (None, False, 0, "auto", {}, []):
                    return f".{field} is {json.dumps(node[field])}"
        return None
    return asks


def _is(*values: Any):
    """A value among `values`: ` is value`."""
    return lambda value: f" is {json.dumps(value)}" if value in values else None


def _is_not(off: Any):
    """Any value but `off`: ` is value`."""
    return lambda value: f" is {json.dumps(value)}" if value is not off else None


def _logs_unseen(node: Any) -> str | None:
    """comms_logger on without verbose: it records, and only the script's log_summary() would print."""
    return None if _turns_on("verbose")(node) else _turns_on("enabled")(node)


# The "refused" keys: (what of it asks for something, why this toolkit cannot honour it, what to do).
# tensor_parallel, sequence_parallel_size and pipeline have their own lines in _refuse_unsupported.
REFUSALS = {
    "expert_parallel": (_turns_on("enabled"), "DeepSpeed's AutoEP swaps a model's MoE layers for expert-parallel "
                        "ones, which this toolkit's loading, LoRA and saving do not know; MoE models train data "
                        "parallel here", "remove the expert_parallel section"),
    "use_data_before_expert_parallelism": (_is(True), "it lays out expert-parallel groups, which this toolkit does "
                                           "not run", "remove it"),
    "hybrid_engine": (_turns_on("enabled"), "DeepSpeed-Chat's hybrid engine (inference kernels for RLHF "
                      "generation) is not run by this toolkit", "remove the hybrid_engine section"),
    "autotuning": (_turns_on("enabled"), "DeepSpeed's autotuner runs under `deepspeed --autotuning` and ends the "
                   "process at its last profiled step", "remove it; `toolkit estimate` says which layout fits"),
    "data_efficiency": (_turns_on("enabled"), "curriculum learning and random-LTD need DeepSpeed's own data loader "
                        "and layer hooks; the recipe's data section decides the rows here",
                        "remove the data_efficiency section"),
    "dataloader_drop_last": (_is(True), "it applies to DeepSpeed's own data loader, which accelerate does not use "
                             "here", "remove it"),
    "activation_checkpointing": (_turns_on(), "DeepSpeed's activation checkpointing acts only on models that call "
                                 "deepspeed.checkpointing, which Hugging Face models do not",
                                 "remove the section and set model.gradient_checkpointing=true"),
    "torch_autocast": (_turns_on("enabled"), "precision is the recipe's train.precision (bf16 and fp16 map to "
                       "DeepSpeed's own sections)", "remove the torch_autocast section"),
    "managed_gradient_accumulation": (_is(False), "the loop hands DeepSpeed gradient_accumulation_steps micro-batches "
                                      "and DeepSpeed steps on the boundary; false would step on every micro-batch",
                                      "remove it"),
    "gradient_allreduce_op": (_is("sum"), "the loop scales the loss for DeepSpeed's averaged gradients; summed ones "
                              "would be larger by the number of processes", "remove it (mean)"),
    "weight_quantization": (_turns_on("quantized_initialization", "post_init_quant"), "weight quantization is "
                            "ZeRO-Inference's, not training's", "remove it; for a quantized base train QLoRA "
                            "(model.load_in_4bit)"),
    "datastates_ckpt": (_is_not(False), "this toolkit writes each checkpoint, reads it back and renames it "
                        "into place; an asynchronous checkpoint engine would race that (DeepSpeed turns it on for "
                        "any value but false)", "remove the datastates_ckpt section"),
    "checkpoint": (_turns_on("load_universal"), "DeepSpeed would read its universal format, not the checkpoints "
                   "this toolkit writes; resuming under another layout is the toolkit's own (its portable state)",
                   "remove checkpoint.load_universal"),
    "compile": (_turns_on("deepcompile"), "DeepCompile runs only when the script calls engine.compile(), which this "
                "toolkit does not", "compile in the recipe instead (train.compile: true)"),
    "comms_logger": (_logs_unseen, "DeepSpeed prints its summary only when the script calls "
                     "deepspeed.comm.log_summary(), which this toolkit does not", "set comms_logger.verbose true to "
                     "log each collective as it runs (`toolkit doctor` measures their bandwidth)"),
}


def load_json(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ToolkitError(f"deepspeed config not found: {path}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ToolkitError(f"{path}: line {e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise ToolkitError(f"{path}: a DeepSpeed config must be a JSON object")
    return cfg


def resolve(cfg: dict, recipe: Recipe, world_size: int, source: str, *, total_steps: int | None = None,
            hidden_size: int | None = None, notes: list[str] | None = None) -> dict:
    """Return a copy of `cfg` with "auto" filled from the recipe; raise on contradictions and on
    what DeepSpeed or this toolkit would reject. `total_steps` and `hidden_size` are filled when
    known (after data and model are built). What was changed is appended to `notes`."""
    notes = [] if notes is None else notes
    _check_unknown_keys(cfg, source, notes)
    cfg = copy.deepcopy(cfg)
    t = recipe.train

    def settle(node: dict, key: str, value: Any, dotted: str, recipe_key: str) -> None:
        if key not in node or node[key] == "auto":
            node[key] = value
        elif not _same(node[key], value):
            raise ToolkitError(f"{source}: {dotted} is {node[key]!r} but the recipe's {recipe_key} gives "
                               f"{value!r}; set it to \"auto\" or change the recipe")

    settle(cfg, "train_micro_batch_size_per_gpu", t.micro_batch_size, "train_micro_batch_size_per_gpu",
           "train.micro_batch_size")
    settle(cfg, "gradient_accumulation_steps", t.gradient_accumulation_steps, "gradient_accumulation_steps",
           "train.gradient_accumulation_steps")
    settle(cfg, "train_batch_size", t.micro_batch_size * t.gradient_accumulation_steps * world_size,
           "train_batch_size", f"train.micro_batch_size x train.gradient_accumulation_steps x {world_size} processes")
    settle(cfg, "gradient_clipping", t.max_grad_norm, "gradient_clipping", "train.max_grad_norm")

    if "bfloat16" in cfg:  # legacy section name
        if "bf16" in cfg:
            raise ToolkitError(f"{source}: bfloat16 and bf16 are the same section (bfloat16 is its old name); keep one")
        cfg["bf16"] = cfg.pop("bfloat16")
        notes.append(f"{source}: bfloat16 read as bf16 (its current name)")
    for section, wanted in (("fp16", t.precision == "fp16"), ("bf16", t.precision == "bf16")):
        node = cfg.setdefault(section, {})
        if not isinstance(node, dict):
            raise ToolkitError(f"{source}: {section} must be an object such as {{\"enabled\": \"auto\"}}")
        enabled = node.get("enabled", "auto")
        if enabled != "auto" and bool(enabled) != wanted:
            raise ToolkitError(f"{source}: {section}.enabled is {enabled!r} but the recipe's train.precision is "
                               f"{t.precision!r}; set it to \"auto\" or change the recipe")
        node["enabled"] = wanted
        if section == "fp16":  # dynamic loss scaling starts where the recipe says (fp16 only)
            power = int(math.log2(t.initial_loss_scale))
            if wanted:
                settle(node, "initial_scale_power", power, "fp16.initial_scale_power",
                       f"train.initial_loss_scale ({t.initial_loss_scale:g} = 2^{power})")
            elif node.get("initial_scale_power") == "auto":
                node["initial_scale_power"] = power
        if section == "bf16":  # loss-scaling keys copied from an fp16 section: bf16 scales nothing
            for key in [k for k in node if k in LOSS_SCALING_KEYS]:
                del node[key]
                notes.append(f"{source}: bf16.{key} dropped (loss scaling is fp16's; bf16 needs none)")
        for key in [k for k, v in node.items() if v == "auto"]:  # e.g. loss_scale_window: the library's default
            del node[key]
            notes.append(f"{source}: {section}.{key} \"auto\" -> DeepSpeed's default")

    if "optimizer" in cfg:
        _resolve_optimizer(cfg["optimizer"], t, source, settle, notes)
    _check_recipe_optimizer(cfg, recipe, source)
    if "scheduler" in cfg:
        _resolve_scheduler(cfg["scheduler"], t, source, notes, total_steps)

    zero = cfg.setdefault("zero_optimization", {})
    zero.setdefault("stage", 0)  # DeepSpeed's default, written out: accelerate reads it when saving
    normalize_zero(zero, source, notes)
    if zero.get("stage", 0) == 3:
        # Saving gathers the full weights once; without this ZeRO-3 saves empty tensors.
        if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
            notes.append(f"{source}: zero_optimization.stage3_gather_16bit_weights_on_model_save false -> true "
                         "(the final model is gathered once to be saved)")
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    for part in ("offload_optimizer", "offload_param"):
        node = zero.get(part) or {}
        if node.get("device") == "nvme":
            nvme = node.get("nvme_path")
            if not nvme or nvme == "auto" or not Path(nvme).is_dir():
                raise ToolkitError(f"{source}: zero_optimization.{part}.nvme_path: folder does not exist: {nvme}")
    if hidden_size is not None:
        for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                           ("stage3_param_persistence_threshold", 10 * hidden_size)):
            if zero.get(key) == "auto":
                zero[key] = value
    every = cfg.get("steps_per_print", "auto")
    if isinstance(every, (int, float)) and not isinstance(every, bool) and every < 10**9:
        notes.append(f"{source}: steps_per_print {every:g} not used: accelerate turns DeepSpeed's progress print "
                     "off; the toolkit's step lines replace it (train.log_every_steps)")
    cfg["steps_per_print"] = 10**9
    _map_legacy_compile(cfg, source, notes)
    validate(cfg, source)
    _refuse_unsupported(cfg, source)
    return cfg


def _check_unknown_keys(cfg: dict, source: str, notes: list[str]) -> None:
    """A top-level key DeepSpeed does not read is ignored by DeepSpeed, and here too, with a note naming it
    and its near miss (public JSONs carry `cuda_visible_devices`, LLaMA-Factory's `comms_config`). Refused
    only where it is a near miss of a key that changes what is learned or how memory is laid out
    (MATTERS): a misspelt `zero_optimization` would train without it. `_comment`-style keys (a leading
    underscore) are comments."""
    import difflib

    for key in cfg:
        if key in TOP_LEVEL_KEYS or str(key).startswith("_"):
            continue
        close = difflib.get_close_matches(str(key), sorted(TOP_LEVEL_KEYS), n=1, cutoff=0.75)
        hint = PEER_KEYS.get(key) or (close[0] if close else None)
        if key not in PEER_KEYS and close and close[0] in MATTERS:
            raise ToolkitError(f"{source}: {key}: not a key DeepSpeed reads (it would ignore it); did you mean "
                               f"{hint}?")
        notes.append(f"{source}: {key}: not a key DeepSpeed reads; ignored, as DeepSpeed ignores it"
                     + (f" (did you mean {hint}?)" if hint else ""))


def _resolve_optimizer(opt: dict, t, source: str, settle, notes: list[str]) -> None:
    """The JSON's optimizer type is kept (DeepSpeed builds it); its hyper-parameters are the recipe's."""
    import torch
    from deepspeed.runtime import config as ds_config

    kind = str(opt.get("type", ""))
    known = set(ds_config.DEEPSPEED_OPTIMIZERS) | {getattr(ds_config, n) for n in dir(ds_config)
                                                   if n.endswith("_OPTIMIZER")
                                                   and isinstance(getattr(ds_config, n), str)}
    if kind.lower() not in known and not hasattr(torch.optim, kind):
        raise ToolkitError(f"{source}: optimizer.type {kind!r} is neither a DeepSpeed optimizer "
                           f"({', '.join(sorted(ds_config.DEEPSPEED_OPTIMIZERS))}) nor one of torch.optim")
    params = opt.setdefault("params", {})
    for key, value, recipe_key in (("lr", t.learning_rate, "train.learning_rate"),
                                   ("betas", [t.adam_beta1, t.adam_beta2], "train.adam_beta1/adam_beta2"),
                                   ("eps", t.adam_epsilon, "train.adam_epsilon"),
                                   ("weight_decay", t.weight_decay, "train.weight_decay")):
        if key in params or kind.lower() in ("adam", "adamw"):
            settle(params, key, value, f"optimizer.params.{key}", recipe_key)
    unfilled = [k for k, v in params.items() if v == "auto"]
    if unfilled:
        raise ToolkitError(f"{source}: optimizer.params.{unfilled[0]} is \"auto\" but the recipe has no value for "
                           "it; set a number")
    notes.append(f"{source}: optimizer {kind} from this file (DeepSpeed builds it), with the recipe's lr, betas, "
                 "eps and weight_decay")


def _check_recipe_optimizer(cfg: dict, recipe: Recipe, source: str) -> None:
    """train.optim under DeepSpeed: an elementwise torch optimizer only (ZeRO steps it over flat partitions); none
    beside the JSON's own optimizer block unless the same kind (an AdamW beside Adam/AdamW, muon beside Muon; the
    JSON's then decides, as before); only AdamW under optimizer offload (DeepSpeed's CPU Adam steps it on the host).
    The JSON's own Muon keeps its momentum in DeepSpeed's layout, which the portable state cannot name."""
    t = recipe.train
    adamw = t.optim in ("adamw_torch", "adamw_torch_fused")
    kind = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if kind == "muon" and recipe.checkpoint.portable:
        raise ToolkitError(f"{source}: optimizer Muon (DeepSpeed's) keeps its momentum in DeepSpeed's own layout, "
                           "which a portable checkpoint cannot name yet: set checkpoint.portable=false (a resume then "
                           "needs this launch), or train.optim=muon without this block under DDP")
    agrees = t.optim == "adamw_torch" or adamw and kind in ("adam", "adamw") or t.optim == kind == "muon"
    if "optimizer" in cfg and not agrees:
        raise ToolkitError(f"train.optim is {t.optim} but {source} brings its own optimizer "
                           f"({cfg['optimizer'].get('type')}); remove one of the two")
    problem = optimizers.sharding_problem(t.optim, "DeepSpeed steps the optimizer over flat partitions of them")
    if problem and "optimizer" not in cfg:  # a JSON's own Muon is DeepSpeed's, built for its partitions
        raise ToolkitError(f"train.optim: {problem}" + ("; or give your DeepSpeed JSON an optimizer block of type "
                                                        "Muon (DeepSpeed's own)" if t.optim == "muon" else ""))
    device = ((cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    if device in ("cpu", "nvme") and not adamw and "optimizer" not in cfg:
        raise ToolkitError(f"train.optim is {t.optim} but {source} offloads the optimizer to {device}, where "
                           "DeepSpeed steps its own CPU Adam; use adamw_torch, or turn the offload off")


def scheduler_class(kind: str):
    """DeepSpeed looks a scheduler type up in its own lr_schedules, then in torch.optim.lr_scheduler."""
    import torch
    from deepspeed.runtime import lr_schedules

    return getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind, None)


def _resolve_scheduler(sched: dict, t, source: str, notes: list[str], total_steps: int | None) -> None:
    """The JSON's schedule is kept, fixed values included (each one that differs from the recipe is
    noted); "auto" and absent values come from the recipe, and only the parameters this scheduler
    type takes are filled (WarmupLR has no total_num_steps)."""
    kind = str(sched.get("type", ""))
    cls = scheduler_class(kind)
    if cls is None:
        from deepspeed.runtime import lr_schedules

        raise ToolkitError(f"{source}: scheduler.type {kind!r} is not a DeepSpeed scheduler "
                           f"({', '.join(lr_schedules.VALID_LR_SCHEDULES)}) nor one of torch.optim.lr_scheduler")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "optimizer",
                                                                                      "last_batch_iteration")]
    params = sched.setdefault("params", {})
    for key in list(params):
        if key not in accepted:
            if params[key] == "auto":  # Trainer-style templates list it for every type
                del params[key]
                notes.append(f"{source}: scheduler.params.{key} \"auto\" dropped ({kind} takes no {key})")
            else:
                raise ToolkitError(f"{source}: scheduler.params.{key}: {kind} takes no such parameter "
                                   f"(it takes {', '.join(accepted)})")
    warmup = t.warmup_steps or (math.ceil(t.warmup_ratio * total_steps) if total_steps else 0)
    if "warmup_num_steps" in accepted and warmup < 1 and params.get("warmup_num_steps", "auto") == "auto":
        warmup = 1  # DeepSpeed requires a positive count (and warms up over at least 2 steps)
        notes.append(f"{source}: scheduler.params.warmup_num_steps \"auto\" -> 1: the recipe has no warmup "
                     "and DeepSpeed's warmup schedulers need at least one step")
    fills = {"warmup_max_lr": (t.learning_rate, "train.learning_rate"),
             "warmup_num_steps": (warmup, "train.warmup_steps"),
             "total_num_steps": (total_steps, "train.max_steps (or epochs x steps per epoch)")}
    for key, (value, recipe_key) in fills.items():
        if key not in accepted or value is None:
            continue
        if params.get(key, "auto") == "auto":
            params[key] = value
        elif not _same(params[key], value):  # the file's own schedule, as written
            notes.append(f"{source}: scheduler.params.{key} {params[key]!r} kept from this file (the recipe's "
                         f"{recipe_key} gives {value!r})")
    autos = {"warmup_min_lr": 0.0, "warmup_min_ratio": 0.0, "cos_min_ratio": t.min_lr_ratio,
             "cycle_max_lr": t.learning_rate, "cycle_min_lr": t.learning_rate * t.min_lr_ratio,
             "lr_range_test_min_lr": t.learning_rate}
    for key in [k for k, v in params.items() if v == "auto"]:
        if key in autos:
            params[key] = autos[key]
        elif not (key == "total_num_steps" and total_steps is None):
            raise ToolkitError(f"{source}: scheduler.params.{key} is \"auto\" but the recipe has no value for it; "
                               "set a number")
    notes.append(f"{source}: learning-rate schedule {kind} from this file (the recipe's train.lr_scheduler_type "
                 "and min_lr_ratio are not used)")


def normalize_zero(zero: dict, source: str, notes: list[str]) -> None:
    """One spelling per zero_optimization field: DeepSpeed's schema fails when a field appears
    under two names (e.g. a legacy one and the current one)."""
    for old, new in ZERO_OFFLOAD_SWITCHES.items():
        if old in zero:
            on = zero.pop(old)
            if on:
                if zero.get(new):
                    raise ToolkitError(f"{source}: zero_optimization.{old} and zero_optimization.{new} both set; "
                                       f"keep {new}")
                zero[new] = {"device": "cpu"}
            notes.append(f"{source}: zero_optimization.{old} (legacy) -> {new}" + (".device cpu" if on else " off"))
    if "cpu_offload_use_pin_memory" in zero:
        pin = zero.pop("cpu_offload_use_pin_memory")
        for part in ZERO_OFFLOAD_SWITCHES.values():
            if isinstance(zero.get(part), dict):
                zero[part].setdefault("pin_memory", pin)
        notes.append(f"{source}: zero_optimization.cpu_offload_use_pin_memory (legacy) -> pin_memory of the offloads")
    for old, new in ZERO_SPELLINGS.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if new in zero and not _same(zero[new], value):
            raise ToolkitError(f"{source}: zero_optimization.{old} is {value!r} but zero_optimization.{new} (the same "
                               f"setting) is {zero[new]!r}; keep one")
        zero.setdefault(new, value)
        notes.append(f"{source}: zero_optimization.{old} read as {new}")


def _refuse_unsupported(cfg: dict, source: str) -> None:
    """What DeepSpeed accepts and this toolkit cannot honour (TOP_LEVEL_KEYS' "refused"). Model
    parallelism changes what each rank holds and sees; the loop is data parallel only."""
    tp = cfg.get("tensor_parallel") or {}
    size = tp.get("autotp_size", tp.get("tp_size", 1)) if isinstance(tp, dict) else 1
    if size not in (None, "auto", 0, 1):
        raise ToolkitError(f"{source}: tensor_parallel.autotp_size is {size}: tensor parallelism (AutoTP) is not "
                           "supported by this toolkit (data parallel only); remove the tensor_parallel section "
                           "and use ZeRO-3 to fit a larger model")
    sp = cfg.get("sequence_parallel_size", 1)
    if sp not in (None, "auto", 1):
        raise ToolkitError(f"{source}: sequence_parallel_size is {sp}: sequence parallelism comes from the accelerate "
                           "config here (parallelism_config_sp_size with sp_backend: deepspeed); remove it")
    if cfg.get("pipeline"):  # DeepSpeed fills its defaults in; any other value is for its PipelineModule
        from deepspeed.runtime.config import get_pipeline_config

        default = get_pipeline_config({})
        for key, value in cfg["pipeline"].items():
            if value != default.get(key, object()) and not (key == "stages" and value == 1):
                raise ToolkitError(f"{source}: pipeline.{key} is {value!r}: pipeline parallelism (DeepSpeed's "
                                   "PipelineModule) is not supported by this toolkit; remove the pipeline section")
    for key, (asks, why, fix) in REFUSALS.items():
        what = asks(cfg[key]) if key in cfg else None
        if what:
            raise ToolkitError(f"{source}: {key}{what}: {why}; {fix}")


def _map_legacy_compile(cfg: dict, source: str, notes: list[str]) -> None:
    """DeepSpeed < 0.17 read `compile: {enabled|disable, backend, kwargs}`; today's schema keeps
    only DeepCompile switches, and compiling is the script's call (the recipe's `train.compile`)."""
    node = cfg.get("compile")
    if not isinstance(node, dict):
        return
    legacy = [k for k in ("enabled", "disable", "backend", "kwargs") if k in node]
    if not legacy:
        return
    if node.get("enabled") is True:
        raise ToolkitError(f"{source}: compile.enabled is true: compile in the recipe instead (train.compile: "
                           "true compiles each decoder layer, dynamic shapes); remove the compile section")
    for k in legacy:
        del node[k]
    if not node:
        del cfg["compile"]
    notes.append(f"{source}: compile.{'/'.join(legacy)} (the pre-0.17 compile section) dropped: compiling is "
                 "the recipe's train.compile")


def validate(cfg: dict, source: str) -> None:
    """DeepSpeed's own parser on the resolved config (batch sizes taken as one process: this is
    about keys and values, the batch arithmetic is settled above). One line on failure."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(cfg)
    _drop_auto(probe)
    from deepspeed import comm

    world = comm.get_world_size() if comm.is_initialized() else 1  # the world DeepSpeedConfig checks against
    probe["train_batch_size"] = probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"] * world
    for part in ("offload_optimizer", "offload_param"):  # existence checked above; DeepSpeed probes the path
        node = probe.get("zero_optimization", {}).get(part)
        if isinstance(node, dict) and node.get("device") == "nvme":
            node.pop("nvme_path", None)
    try:
        import logging

        from deepspeed.utils import logger

        level = logger.level
        logger.setLevel(logging.ERROR)  # deprecation chatter is reported as notes instead
        try:
            DeepSpeedConfig(probe)
        finally:
            logger.setLevel(level)
    except Exception as e:  # pydantic's ValidationError, DeepSpeedConfigError, AssertionError, ...
        raise ToolkitError(f"{source}: {_explain(e)}") from None


SCHEMA_SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "CompileConfig": "compile",
                   "DeepSpeedFP16Config": "fp16",
                   "DeepSpeedBF16Config": "bf16", "CommsLoggerConfig": "comms_logger",
                   "DeepSpeedMonitorConfig": "", "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
                   "DeepSpeedFlopsProfilerConfig": "flops_profiler", "DeepSpeedAIOConfig": "aio",
                   "DeepSpeedTPConfig": "tensor_parallel", "DeepSpeedTorchAutocastConfig": "torch_autocast"}


def _explain(e: Exception) -> str:
    import deepspeed

    errors = getattr(e, "errors", None)
    if callable(errors):
        first, n = errors()[0], len(errors())
        section = SCHEMA_SECTIONS.get(getattr(e, "title", ""), getattr(e, "title", ""))
        key = ".".join([section] * bool(section) + [str(p) for p in first["loc"]])
        what = ("not a key DeepSpeed accepts here" if first["type"] == "extra_forbidden" else first["msg"])
        more = f" (and {n - 1} more)" if n > 1 else ""
        return f"{key}: {what}{more} (DeepSpeed {deepspeed.__version__})"
    return f"DeepSpeed {deepspeed.__version__} rejects this config: {' '.join(str(e).split())}"


def _drop_auto(node: Any) -> None:
    if isinstance(node, dict):
        for k in [k for k, v in node.items() if v == "auto"]:
            del node[k]
        for v in node.values():
            _drop_auto(v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))
    return a == b


def config_source() -> str | None:
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    return None if path in ("", "none") else path


def make_plugin(recipe: Recipe, world_size: int, notes: list[str] | None = None):
    """The DeepSpeedPlugin for this launch, its config resolved from the recipe."""
    from accelerate.utils import DeepSpeedPlugin

    path = config_source()
    hidden = model_hidden_size(recipe)
    if path is not None:
        resolved = resolve(load_json(path), recipe, world_size, path, hidden_size=hidden, notes=notes)
        return DeepSpeedPlugin(hf_ds_config=resolved)
    plugin = DeepSpeedPlugin()  # inline deepspeed_config settings from the accelerate YAML
    resolved = resolve(plugin.deepspeed_config, recipe, world_size, "accelerate config (deepspeed_config)",
                       hidden_size=hidden, notes=notes)
    plugin.deepspeed_config.clear()
    plugin.deepspeed_config.update(resolved)
    return plugin


def finalize(cfg: dict, recipe: Recipe, world_size: int, total_steps: int, hidden_size: int | None) -> None:
    """Fill, in place, the values known only once data and model exist."""
    path = config_source() or "accelerate config (deepspeed_config)"
    resolved = resolve(cfg, recipe, world_size, path, total_steps=total_steps, hidden_size=hidden_size)
    cfg.clear()
    cfg.update(resolved)


def model_hidden_size(recipe: Recipe) -> int | None:
    """hidden_size from the model's config.json, without building the model."""
    if recipe.model.preset is not None:
        from ..model.load import PRESETS

        path = PRESETS / f"{recipe.model.preset}.json"
    else:
        path = Path(recipe.model.path) / "config.json"
    try:
        return json.loads(path.read_text()).get("hidden_size")
    except (OSError, json.JSONDecodeError):
        return None
