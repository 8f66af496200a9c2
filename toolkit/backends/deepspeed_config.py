"""DeepSpeed configs as users bring them: resolve every "auto" from the recipe, map legacy
spellings, refuse contradictions and what this toolkit cannot run, each in one line.

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
    cfg = copy.deepcopy(cfg)
    notes = [] if notes is None else notes
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
    cfg["steps_per_print"] = cfg.get("steps_per_print", 10**9) if cfg.get("steps_per_print") != "auto" else 10**9
    _refuse_unsupported(cfg, source)
    _map_legacy_compile(cfg, source, notes)
    validate(cfg, source)
    return cfg


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
    warmup = t.warmup_steps
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
    notes.append(f"{source}: learning-rate schedule {kind} from this file (the recipe's warmup-cosine schedule "
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
    """Model parallelism changes what each rank holds and sees; the loop is data parallel only."""
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
    if cfg.get("pipeline") and (cfg["pipeline"].get("stages", 1) not in (1, "auto")):
        raise ToolkitError(f"{source}: pipeline: pipeline parallelism is not supported by this toolkit; remove it")


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
