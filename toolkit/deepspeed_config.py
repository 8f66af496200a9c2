"""DeepSpeed configs as users bring them: resolve every "auto" from the recipe, refuse contradictions.

The recipe is the single source of truth for batch sizes, accumulation, clipping, precision and
the optimizer. A DeepSpeed JSON written for the Hugging Face Trainer ("auto" almost everywhere)
is filled in from it; a fixed value that disagrees with the recipe stops the run before
training, naming the file, the key and both values.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from .config import Recipe, ToolkitError

LEGACY_KEYS = {  # old name -> current name, inside zero_optimization
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "cpu_offload": None,  # handled below: becomes offload_optimizer.device=cpu
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
            hidden_size: int | None = None) -> dict:
    """Return a copy of `cfg` with "auto" filled from the recipe; raise on contradictions.
    `total_steps` and `hidden_size` are filled when known (after data and model are built)."""
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

    for section, wanted in (("fp16", t.precision == "fp16"), ("bf16", t.precision == "bf16")):
        if section == "bf16" and "bfloat16" in cfg:  # legacy section name
            cfg["bf16"] = cfg.pop("bfloat16")
        node = cfg.setdefault(section, {})
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

    if "optimizer" in cfg:
        params = cfg["optimizer"].setdefault("params", {})
        for key, value, recipe_key in (("lr", t.learning_rate, "train.learning_rate"),
                                       ("betas", [t.adam_beta1, t.adam_beta2], "train.adam_beta1/adam_beta2"),
                                       ("eps", t.adam_epsilon, "train.adam_epsilon"),
                                       ("weight_decay", t.weight_decay, "train.weight_decay")):
            settle(params, key, value, f"optimizer.params.{key}", recipe_key)
    if "scheduler" in cfg:
        params = cfg["scheduler"].setdefault("params", {})
        settle(params, "warmup_num_steps", t.warmup_steps, "scheduler.params.warmup_num_steps", "train.warmup_steps")
        settle(params, "warmup_max_lr", t.learning_rate, "scheduler.params.warmup_max_lr", "train.learning_rate")
        if params.get("warmup_min_lr", "auto") == "auto":
            params["warmup_min_lr"] = 0.0
        if total_steps is not None:
            settle(params, "total_num_steps", total_steps, "scheduler.params.total_num_steps",
                   "train.max_steps (or epochs x steps per epoch)")

    zero = cfg.setdefault("zero_optimization", {})
    for old, new in LEGACY_KEYS.items():
        if old in zero and new is not None:
            zero.setdefault(new, zero.pop(old))
    if zero.pop("cpu_offload", False):
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    if zero.get("stage", 0) == 3:
        # Saving gathers the full weights once; without this ZeRO-3 saves empty tensors.
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
    return cfg


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


def make_plugin(recipe: Recipe, world_size: int):
    """The DeepSpeedPlugin for this launch, its config resolved from the recipe."""
    from accelerate.utils import DeepSpeedPlugin

    path = config_source()
    if path is not None:
        resolved = resolve(load_json(path), recipe, world_size, path)
        return DeepSpeedPlugin(hf_ds_config=resolved)
    plugin = DeepSpeedPlugin()  # inline deepspeed_config settings from the accelerate YAML
    resolved = resolve(plugin.deepspeed_config, recipe, world_size, "accelerate config (deepspeed_config)")
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
        from .model import PRESETS

        path = PRESETS / f"{recipe.model.preset}.json"
    else:
        path = Path(recipe.model.path) / "config.json"
    try:
        return json.loads(path.read_text()).get("hidden_size")
    except (OSError, json.JSONDecodeError):
        return None


def show_resolved(recipe: Recipe, accelerate_config: str, num_processes: int | None) -> str:
    """The DeepSpeed config a launch with this accelerate YAML would train with."""
    try:
        launch = yaml.safe_load(Path(accelerate_config).read_text()) or {}
    except FileNotFoundError:
        raise ToolkitError(f"accelerate config not found: {accelerate_config}") from None
    except yaml.YAMLError as e:
        raise ToolkitError(f"{accelerate_config}: invalid YAML ({e})") from None
    world = num_processes or int(launch.get("num_processes", 1)) * 1
    if launch.get("distributed_type") != "DEEPSPEED":
        return f"# {accelerate_config}: distributed_type {launch.get('distributed_type')}, no DeepSpeed config"
    ds = launch.get("deepspeed_config") or {}
    path = ds.get("deepspeed_config_file")
    if not path:
        raise ToolkitError(f"{accelerate_config}: deepspeed_config.deepspeed_config_file is not set; "
                           "`config show` resolves file-based DeepSpeed configs")
    resolved = resolve(load_json(path), recipe, world, path, total_steps=recipe.train.max_steps,
                       hidden_size=model_hidden_size(recipe))
    return f"# {path} resolved for {world} process(es)\n" + json.dumps(resolved, indent=2)
