"""A TRL config read as a recipe: the flat YAML (or JSON) that `trl sft --config`, `trl dpo --config` and
`trl grpo --config` take (TRL's script arguments, model arguments and SFTConfig / DPOConfig / GRPOConfig fields
in one mapping) becomes the recipe's sections. Every field this toolkit follows is in FIELDS (docs/trl-configs.md
is generated from it); the fields it does not follow are named in one note line, never silently dropped.

A file is a TRL config when none of its keys is a recipe section (model, lora, data, train, ...) and it names
`model_name_or_path`. Which trainer
it is for: `toolkit train CONFIG.yaml --trl sft|dpo|grpo`, or found from the fields only that trainer has
(`num_generations`, `reward_funcs`, ... for GRPO; `beta`, `loss_type`, ... for DPO; else SFT).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ConfigError
from .objectives import DPO_OPTIONS

SECTIONS = ("model", "lora", "data", "train", "checkpoint", "preference", "rl")
GRPO_ONLY = ("num_generations", "reward_funcs", "max_completion_length", "use_vllm", "vllm_mode", "num_iterations",
             "epsilon", "scale_rewards", "mask_truncated_completions", "temperature", "top_p", "top_k",
             "max_tool_calling_iterations", "max_staleness")
DPO_ONLY = ("beta", "loss_type", "rpo_alpha", "max_prompt_length", "precompute_ref_log_probs", "label_smoothing",
            "reference_free", "ref_model_init_kwargs", *DPO_OPTIONS)
SFT_LOSS_TYPES = ("nll", "dft", "chunked_nll")  # SFTConfig.loss_type (chunked_nll: deprecated, nll)
# Read by TRL and transformers for things this toolkit does its own way or not at all (logging, the Hub, data
# loaders, process groups): named in the note, nothing to follow.
HOUSEKEEPING = {"logging_dir", "logging_strategy", "logging_first_step", "log_level", "log_level_replica",
                "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "do_train", "do_eval",
                "dataloader_num_workers", "dataloader_pin_memory", "dataloader_drop_last", "disable_tqdm",
                "remove_unused_columns", "ddp_find_unused_parameters", "ddp_timeout", "save_only_model", "env",
                "dataset_num_proc", "trust_remote_code", "use_cpu", "tf32", "save_safetensors", "bf16_full_eval",
                "eval_on_start", "include_num_input_tokens_seen", "gradient_checkpointing_kwargs"}


def _steps_or_none(v: Any) -> Any:
    return None if v in (-1, None) else v


def _epochs(v: Any) -> Any:
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"num_train_epochs {v}: this toolkit trains whole epochs; use max_steps for a part of one")
    return int(v)


def _report_to(v: Any) -> list:
    names = [v] if isinstance(v, str) else list(v or [])
    if names in (["none"], []):
        return []
    if names == ["all"]:
        raise ValueError("report_to all: name the trackers (tensorboard, wandb, mlflow, trackio)")
    return names


def _optim_args(v: Any) -> dict:
    """TRL's `optim_args` string, `momentum=0.9,nesterov=True`, as a mapping."""
    if isinstance(v, dict):
        return v
    import yaml

    return {k.strip(): yaml.safe_load(val) for k, _, val in (part.partition("=") for part in str(v).split(",")) if k}


def _dtype(v: Any) -> Any:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "auto": None}.get(str(v), v)


# TRL field -> (recipe key, conversion, the trainers it applies to (None: every one), what it means)
FIELDS: dict[str, tuple[str, Callable | None, tuple | None, str]] = {
    "model_name_or_path": ("model.path", None, None, "the model folder or Hub id"),
    "dtype": ("model.dtype", _dtype, None, "bfloat16 / float16 / float32 -> bf16 / fp16 / fp32"),
    "torch_dtype": ("model.dtype", _dtype, None, "as dtype"),
    "attn_implementation": ("model.attn_implementation", None, None, ""),
    "gradient_checkpointing": ("model.gradient_checkpointing", None, None, ""),
    "load_in_4bit": ("model.load_in_4bit", None, None, "QLoRA"),
    "use_peft": ("lora.enabled", None, None, ""),
    "lora_r": ("lora.r", None, None, ""),
    "lora_alpha": ("lora.alpha", None, None, ""),
    "lora_dropout": ("lora.dropout", None, None, ""),
    "lora_target_modules": ("lora.target_modules", None, None, ""),
    "use_rslora": ("lora.use_rslora", None, None, ""),
    "use_dora": ("lora.use_dora", None, None, ""),
    "output_dir": ("output_dir", None, None, ""),
    "overwrite_output_dir": ("overwrite", None, None, ""),
    "seed": ("seed", None, None, ""),
    "learning_rate": ("train.learning_rate", None, None, ""),
    "num_train_epochs": ("train.epochs", _epochs, None, "whole epochs only"),
    "max_steps": ("train.max_steps", _steps_or_none, None, "-1: none"),
    "per_device_train_batch_size": ("train.micro_batch_size", None, None, ""),
    "per_device_eval_batch_size": ("train.eval_batch_size", None, None, ""),
    "gradient_accumulation_steps": ("train.gradient_accumulation_steps", None, None, ""),
    "weight_decay": ("train.weight_decay", None, None, "on matrices only, as every run here"),
    "adam_beta1": ("train.adam_beta1", None, None, ""),
    "adam_beta2": ("train.adam_beta2", None, None, ""),
    "adam_epsilon": ("train.adam_epsilon", None, None, ""),
    "max_grad_norm": ("train.max_grad_norm", None, None, ""),
    "optim": ("train.optim", None, None, ""),
    "optim_args": ("train.optim_args", _optim_args, None, "`k=v,k=v` -> a mapping"),
    "lr_scheduler_type": ("train.lr_scheduler_type", None, None, "TRL's default: linear"),
    "lr_scheduler_kwargs": ("train.lr_scheduler_kwargs", None, None, ""),
    "warmup_ratio": ("train.warmup_ratio", None, None, ""),
    "logging_steps": ("train.log_every_steps", lambda v: max(1, math.ceil(v)), None, ""),
    "eval_steps": ("train.eval_every_steps", lambda v: int(v or 0), None, "with eval_strategy steps"),
    "save_steps": ("checkpoint.every_steps", lambda v: int(v or 0), None, "with save_strategy steps"),
    "save_total_limit": ("checkpoint.keep_last", None, None, ""),
    "report_to": ("train.report_to", _report_to, None, "none: []"),
    "run_name": ("train.run_name", None, None, ""),
    "max_length": ("data.max_seq_len", None, None, ""),
    "packing": ("data.packing", None, ("sft",), ""),
    "padding_free": ("data.padding_free", None, None, ""),
    "beta": ("preference.beta", None, ("dpo",), "GRPO: rl.beta"),
    "loss_type": ("preference.loss_type", None, ("dpo",),
                  "a name or a list; GRPO: rl.loss_type; SFT: train.loss_type (nll, dft; chunked_nll is nll)"),
    "label_smoothing": ("preference.label_smoothing", None, ("dpo",), ""),
    **{name: (f"preference.{name}", None, ("dpo",), {"loss_weights": "one per loss_type name"}.get(name, ""))
       for name in DPO_OPTIONS},  # DPO's loss types' own keys, named alike
    "num_generations": ("rl.num_generations", None, ("grpo",), ""),
    "max_completion_length": ("rl.max_new_tokens", None, ("grpo",), ""),
    "temperature": ("rl.temperature", None, ("grpo",), ""),
    "top_p": ("rl.top_p", None, ("grpo",), ""),
    "top_k": ("rl.top_k", lambda v: v or 0, ("grpo",), ""),
    "num_iterations": ("rl.num_iterations", None, ("grpo",), ""),
    "epsilon": ("rl.epsilon", None, ("grpo",), ""),
    "epsilon_high": ("rl.epsilon_high", None, ("grpo",), ""),
    "scale_rewards": ("rl.scale_rewards", lambda v: {True: "group", False: "none"}.get(v, v), ("grpo",), ""),
    "mask_truncated_completions": ("rl.mask_truncated_completions", None, ("grpo",), ""),
    "max_tool_calling_iterations": ("rl.max_tool_calling_iterations", None, ("grpo",), "with rl.tools"),
    "max_staleness": ("rl.max_staleness", None, ("grpo",),
                      "AsyncGRPOConfig's, with rl.sampler: vllm; a fixed lag here, a bound in TRL (default 4 there)"),
    "reward_funcs": ("rl.rewards", lambda v: [v] if isinstance(v, str) else list(v), ("grpo",),
                     "FILE.py:NAME or module:NAME each"),
}
RENAMED = {"grpo": {"beta": "rl.beta", "loss_type": "rl.loss_type"}, "sft": {"loss_type": "train.loss_type"}}
# TRL 1.16's defaults of the fields above where they differ from the recipe's (read off SFTConfig, DPOConfig and
# GRPOConfig): a field the file leaves out means TRL's value, as `trl sft --config` runs it. (bf16: TRL picks it by
# the device; here train.precision's default, fp32, unless the file says bf16: true.)
TRL_DEFAULTS = {"learning_rate": {"sft": 2e-5, "dpo": 1e-6, "grpo": 1e-6}, "lr_scheduler_type": "linear",
                "num_train_epochs": 3, "per_device_train_batch_size": 8, "gradient_checkpointing": True,
                "optim": "adamw_torch_fused", "logging_steps": 10, "save_steps": 500, "seed": 42,
                "max_length": {"sft": 1024, "dpo": 1024}, "num_generations": {"grpo": 8},
                "max_completion_length": {"grpo": 512}}


def is_trl_config(data: dict) -> bool:
    """A flat mapping of TRL's fields: no recipe section among its keys, and the model as TRL names it."""
    return not any(k in data for k in SECTIONS) and "model_name_or_path" in data


def trainer_of(data: dict, asked: str | None) -> str:
    if asked:
        return asked
    if any(k in data for k in GRPO_ONLY):
        return "grpo"
    dpo = [k for k in DPO_ONLY if k in data and not (k == "loss_type" and data[k] in SFT_LOSS_TYPES)]
    return "dpo" if dpo else "sft"


def from_trl(data: dict, source: str, asked: str | None = None) -> tuple[dict, list[str]]:
    """(the recipe's sections, notes) of a TRL config; a value that cannot be read is one ConfigError naming it."""
    kind = trainer_of(data, asked)
    given = set(data)
    for field, value in TRL_DEFAULTS.items():
        value = value.get(kind) if isinstance(value, dict) else value
        if field not in data and value is not None:
            data = {**data, field: value}
    recipe: dict = {"output_dir": "trainer_output"}  # transformers' TrainingArguments default
    followed, unfollowed = [], []

    def put(key: str, value: Any) -> None:
        node = recipe
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value

    for field, value in data.items():
        if field in FIELDS:
            key, convert, only, _ = FIELDS[field]
            if only is not None and kind not in only:
                key = RENAMED.get(kind, {}).get(field)
                if key is None:
                    unfollowed.append(field)
                    continue
                if key == "train.loss_type" and value == "chunked_nll":  # TRL 1.16: deprecated, nll
                    value = "nll"
            try:
                put(key, convert(value) if convert else value)
            except ValueError as e:
                raise ConfigError(source, field, str(e)) from None
            followed.append(field)
        elif field == "warmup_steps":  # transformers 5: a float under 1 is a ratio of the run's steps
            put("train.warmup_ratio" if isinstance(value, float) and value < 1 else "train.warmup_steps",
                value if isinstance(value, float) and value < 1 else int(value))
            followed.append(field)
        elif field in ("bf16", "fp16"):
            if value:
                put("train.precision", field)
            followed.append(field)
        elif field == "dataset_name":
            entry = {"path": str(value), "split": str(data.get("dataset_train_split") or "train")}
            put("data.train_files", [entry])
            if data.get("eval_strategy", "no") != "no" and data.get("dataset_test_split"):
                put("data.eval_files", [{"path": str(value), "split": str(data["dataset_test_split"])}])
            followed.append(field)
        elif field in ("dataset_train_split", "dataset_test_split", "eval_strategy", "save_strategy"):
            followed.append(field)  # read with dataset_name, eval_steps, save_steps
        elif field in HOUSEKEEPING:
            unfollowed.append(field)
        else:
            unfollowed.append(field)
    if data.get("save_strategy", "steps") != "steps":
        put("checkpoint.every_steps", 0)
    if data.get("eval_strategy", "no") == "no" and "eval_steps" in data:
        put("train.eval_every_steps", 0)
    if data.get("completion_only_loss") is False:
        put("data.train_on_prompt", True)
    if kind == "dpo":
        put("preference.method", "dpo")
    if kind == "grpo":
        put("rl.method", "grpo")
    read = {k for k in ("completion_only_loss", "assistant_only_loss") if k in data}
    unfollowed = [f for f in unfollowed if f not in read]
    mapped = [f for f in followed if f in given]
    notes = [f"{source}: read as TRL's {kind.upper()}Config (trl {kind} --config): {len(mapped)} fields mapped, "
             "TRL's defaults for the rest (docs/trl-configs.md); "
             + (f"not followed here: {', '.join(unfollowed)}" if unfollowed else "every field followed")]
    if kind == "sft" and not data.get("assistant_only_loss"):
        notes.append(f"{source}: a conversation (messages) trains on its assistant turns here (TRL's "
                     "assistant_only_loss: true); TRL's default trains every token: data.train_on_prompt=true")
    return recipe, notes


def mapping_table() -> str:
    """docs/trl-configs.md: each TRL field and the recipe key it becomes."""
    rows = ["| TRL field | recipe key | trainers | notes |", "|---|---|---|---|"]
    for field, (key, _, only, text) in FIELDS.items():
        rows.append(f"| `{field}` | `{key}` | {', '.join(only) if only else 'all'} | {text} |")
    rows += ["| `warmup_steps` | `train.warmup_steps` (a float under 1: `train.warmup_ratio`) | all | |",
             "| `bf16`, `fp16` | `train.precision` | all | |",
             "| `dataset_name`, `dataset_train_split` | `data.train_files: [{path, split}]` | all | |",
             "| `dataset_test_split` with `eval_strategy` | `data.eval_files: [{path, split}]` | all | |",
             "| `save_strategy` other than steps | `checkpoint.every_steps: 0` | all | |",
             "| `completion_only_loss: false` | `data.train_on_prompt: true` | sft | |"]
    return "\n".join(rows)


def reference() -> str:
    """docs/trl-configs.md (`make docs`; tests/test_trl_config.py keeps the two in sync)."""
    return ("# TRL configs as recipes\n\n"
            "`.venv/bin/toolkit train sft_config.yaml` reads the YAML (or JSON) that `trl sft --config`, "
            "`trl dpo --config` or `trl grpo --config` takes: a file whose keys are TRL's (`model_name_or_path`, "
            "no recipe section). The trainer is "
            "found from the fields only it has (GRPO: `num_generations`, `reward_funcs`, ...; DPO: `beta`, "
            "`loss_type`, ...; else SFT), or given: `--trl sft|dpo|grpo`. The start of the run names every field "
            "it does not follow. Generated from `toolkit/config/trl_config.py` (`make docs`).\n\n"
            "Differences to know: `data.format` is found from the columns as TRL does; a conversation trains on its "
            "assistant turns here (TRL's `assistant_only_loss: true`), every token with "
            "`data.train_on_prompt=true` (TRL's default); a Hub `dataset_name` needs `data.format` set "
            "(`.venv/bin/toolkit train CONFIG.yaml data.format=messages`); `reward_funcs` are `FILE.py:NAME` or "
            "`module:NAME` functions (TRL's own reward names and reward model ids are not followed). A field the file "
            "leaves out takes TRL 1.16's default (learning rate 2e-5 for SFT and 1e-6 for DPO and GRPO, linear "
            "schedule, 3 epochs, 8 rows per device, gradient checkpointing, `adamw_torch_fused`, max length 1024); "
            "`bf16` as the file says (TRL picks it by the device).\n\n"
            + mapping_table() + "\n")

