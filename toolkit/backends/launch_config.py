"""The accelerate launch config as the workers see it: refusals and notes before any work.

`accelerate launch --config_file X.yaml` turns the YAML into environment variables for its
workers. `check()` reads those (in a worker) and refuses, in one line naming the key, what the
loop cannot run faithfully; `worker_env()` computes the same variables from a YAML with
accelerate's own launcher code, so `toolkit config show` gives the same verdict before a launch.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import Recipe
from ..errors import ToolkitError, command
from ..optim import optimizers

ENV_SOURCE = "accelerate config"
# With a deepspeed_config_file, accelerate refuses these YAML fields outright (a ValueError on
# every rank); they are settled against the JSON and the recipe here instead.
DS_FILE_IGNORES = {"gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                   "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                   "zero3_save_16bit_model", "mixed_precision"}


def launch_kind(env=os.environ) -> str:
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    return "ddp" if int(env.get("WORLD_SIZE", "1")) > 1 else "single"


def check(recipe: Recipe, env=os.environ, cuda: bool = False, source: str = ENV_SOURCE,
          notes: list[str] | None = None) -> None:
    """Refuse what this launch cannot run as asked; append to `notes` what is changed."""
    notes = [] if notes is None else notes
    kind = launch_kind(env)
    precision = {"fp32": "no"}.get(recipe.train.precision, recipe.train.precision)
    mixed = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mixed == "fp8":
        _check_fp8(recipe, env, kind, cuda, source, notes)
    elif mixed != "no" and mixed != precision:
        raise ToolkitError(f"{source}: mixed_precision is {mixed!r} but the recipe's train.precision is "
                           f"{recipe.train.precision!r}; set train.precision={mixed} (or mixed_precision: 'no')")
    _check_parallelism(recipe, env, kind, source, notes)
    if env.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() not in ("NO", ""):
        raise ToolkitError(f"{source}: dynamo_config.dynamo_backend is {env['ACCELERATE_DYNAMO_BACKEND']!r}: "
                           "compile in the recipe instead (train.compile: true compiles each decoder layer, dynamic "
                           "shapes); set dynamo_backend: 'NO'")
    if kind == "fsdp" and (problem := optimizers.sharding_problem(recipe.train.optim, "FSDP shards them")):
        raise ToolkitError(f"train.optim: {problem}")
    if kind == "fsdp" and not cuda and env.get("FSDP_VERSION", "1") != "2":
        raise ToolkitError(f"{source}: fsdp_config.fsdp_version is {env.get('FSDP_VERSION', '1')} (FSDP1, also when "
                           "the key is absent): it trains on GPUs as it is, but accelerate's FSDP1 cannot run on a "
                           "CPU-only host; to rehearse here, convert it with "
                           f"`{command('accelerate to-fsdp2 --config_file THIS.yaml --output_file THIS-fsdp2.yaml')}`")
    if kind == "fsdp" and not cuda:
        for name, key in (("FSDP_SYNC_MODULE_STATES", "fsdp_sync_module_states"),
                          ("FSDP_CPU_RAM_EFFICIENT_LOADING", "fsdp_cpu_ram_efficient_loading")):
            if env.get(name, "false").lower() == "true":
                notes.append(f"{source}: {key} has no effect on a CPU-only host (every rank builds the same "
                             "weights from the seed); rehearsing without it")
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            notes.append(f"{source}: fsdp_offload_params has no effect on a CPU-only host (parameters already live "
                         "in CPU memory); training with FSDP without offload")
    if recipe.model.kernels != "none" and not cuda:
        raise ToolkitError(f"model.kernels: {recipe.model.kernels}'s Triton kernels run on a CUDA GPU and this host "
                           "has none; set model.kernels=none")
    if recipe.train.precision == "fp16" and not cuda:
        raise ToolkitError("train.precision: fp16 needs dynamic loss scaling, which no backend provides on a "
                           "CPU-only host (accelerate runs fp16 unscaled, DeepSpeed's CPU accelerator has no "
                           "fp16); use train.precision=bf16")
    if kind == "deepspeed" and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") not in ("", "none"):
        fields = [f for f in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if f in DS_FILE_IGNORES]
        _settle_yaml_ds_fields(recipe, env, fields, source, notes)


def fp8(env=os.environ) -> bool:
    """The launch asks for fp8 (mixed_precision: fp8): the Accelerator is built with it, once `check` passed."""
    return env.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp8"


# accelerate's fp8 backends this loop trains with (fp8_config.backend), in the order it picks an installed one
FP8_BACKENDS = {"AO": ("torchao", "torchao"), "TE": ("Transformer Engine", "'transformer_engine[pytorch]'")}


def _check_fp8(recipe: Recipe, env, kind: str, cuda: bool, source: str, notes: list[str]) -> None:
    """mixed_precision fp8, through accelerate's torchao or Transformer Engine backend: the linear layers
    compute in fp8, the rest in bf16 autocast. Refused in one line, naming what is missing, where it cannot
    run: accelerate itself would fall back to fp16 on an older GPU with only a warning."""
    import torch
    from accelerate.utils import is_torchao_available, is_transformer_engine_available

    wanted = env.get("ACCELERATE_FP8_BACKEND", "NO").upper()
    if wanted not in ("NO", *FP8_BACKENDS):
        raise ToolkitError(f"{source}: fp8_config.backend is {wanted}: not supported here; use AO (torchao) or TE "
                           "(Transformer Engine)")
    installed = {"AO": is_torchao_available(), "TE": is_transformer_engine_available()}
    backend = wanted if wanted != "NO" else next((b for b, ok in installed.items() if ok), "AO")
    missing = []
    if not cuda:
        missing.append("a CUDA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell), and this host has none")
    elif torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):  # none: config show --assume-gpu
        missing.append("a GPU of compute capability 8.9 or later, and the {} here has {}.{}".format(
            torch.cuda.get_device_name(), *torch.cuda.get_device_capability()))
    if not installed[backend]:
        name, package = FP8_BACKENDS[backend]
        either = " or Transformer Engine" if wanted == "NO" else ""
        missing.append(f"{name}{either}, not installed ({command('python -m pip install ' + package)})")
    if missing:
        raise ToolkitError(f"{source}: mixed_precision 'fp8' needs " + "; and ".join(missing)
                           + "; use mixed_precision: bf16")
    if recipe.train.precision != "bf16":
        raise ToolkitError(f"{source}: mixed_precision is 'fp8' but the recipe's train.precision is "
                           f"{recipe.train.precision!r}; set train.precision=bf16 (fp8 computes the linear layers "
                           "in fp8 and the rest in bf16)")
    if kind in ("fsdp", "deepspeed"):  # fp8 weights sharded and saved by them: not yet run on a GPU here
        raise ToolkitError(f"{source}: mixed_precision 'fp8' trains on one process or DDP here, not yet under "
                           f"{'FSDP' if kind == 'fsdp' else 'DeepSpeed'}; use mixed_precision: bf16 with it")
    notes.append(f"{source}: mixed_precision fp8 through {FP8_BACKENDS[backend][0]}: the linear layers compute in fp8 "
                 "(accelerate keeps those with a size not a multiple of 16 in bf16"
                 + (", and the first and the last" if backend == "AO" else "") + "), the rest in bf16 autocast")


def sequence_parallel_size(env=os.environ) -> int:
    """parallelism_config_sp_size of the launch (1 without it)."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1
    return int(env.get("PARALLELISM_CONFIG_SP_SIZE", "1"))


def _check_parallelism(recipe: Recipe, env, kind: str, source: str, notes: list[str]) -> None:
    """parallelism_config: sequence parallelism (sp_size, DeepSpeed's Ulysses) runs; tensor and
    context parallelism are refused in one line."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return
    key = "parallelism_config.parallelism_config_{}_size".format
    tp, cp = (int(env.get(f"PARALLELISM_CONFIG_{k}_SIZE", "1")) for k in ("TP", "CP"))
    if tp > 1:
        raise ToolkitError(f"{source}: {key('tp')} is {tp}: tensor parallelism is not supported by this toolkit; "
                           "remove it (ZeRO-3 or FSDP shard a model too large for one GPU)")
    if cp > 1:
        raise ToolkitError(f"{source}: {key('cp')} is {cp}: context parallelism (torch ring attention on FSDP2) is "
                           "not supported by this toolkit; for long sequences use parallelism_config_sp_size with "
                           "distributed_type: DEEPSPEED (Ulysses sequence parallelism)")
    sp = sequence_parallel_size(env)
    if sp <= 1:
        return
    world = int(env.get("WORLD_SIZE", "1"))
    if kind != "deepspeed" or env.get("PARALLELISM_CONFIG_SP_BACKEND", "deepspeed") != "deepspeed":
        raise ToolkitError(f"{source}: {key('sp')} is {sp}: sequence parallelism runs on DeepSpeed (Ulysses); set "
                           "distributed_type: DEEPSPEED and parallelism_config_sp_backend: deepspeed")
    if world % sp:
        raise ToolkitError(f"{source}: {key('sp')} is {sp} but a launch of {world} process(es) does not divide into "
                           f"groups of {sp}; launch a multiple of {sp} processes")
    if recipe.preference.method is not None:
        raise ToolkitError(f"{source}: {key('sp')} is {sp}: sequence parallelism does not run preference training "
                           f"(preference.method={recipe.preference.method}) yet; remove sp_size")
    if recipe.rl.method is not None:  # as the launch's check_objective would, once the model is built
        raise ToolkitError(f"{source}: {key('sp')} is {sp}: online RL (rl.method={recipe.rl.method}) samples and "
                           "scores whole completions, not rows split across ranks; remove sp_size")
    if recipe.model.attn_implementation == "eager":
        raise ToolkitError(f"{source}: {key('sp')} is {sp}: sequence parallelism needs attention without a dense "
                           "mask; set model.attn_implementation=sdpa (or flash_attention_2, varlen)")
    dp = (int(env.get("PARALLELISM_CONFIG_DP_SHARD_SIZE", "1"))
          * int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")))
    if dp not in (1, world // sp):
        notes.append(f"{source}: parallelism_config dp_shard_size x dp_replicate_size is {dp}; {world} processes in "
                     f"groups of {sp} make {world // sp} data-parallel ranks, trained as such")
    wanted = env.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
    if wanted not in (None, "", "None", recipe.model.attn_implementation):
        notes.append(f"{source}: parallelism_config_sp_attn_implementation {wanted} not used: the recipe's "
                     f"model.attn_implementation ({recipe.model.attn_implementation}) decides the attention")
    if env.get("PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE", "true").lower() != "true":
        notes.append(f"{source}: parallelism_config_sp_seq_length_is_variable false not used: batches are as long "
                     "as their longest row")


def _settle_yaml_ds_fields(recipe: Recipe, env, fields: list[str], source: str, notes: list[str]) -> None:
    """accelerate refuses a YAML that sets these beside a deepspeed_config_file; the recipe and the
    JSON decide them, so a YAML value is accepted where it agrees and refused where it contradicts."""
    import json

    path = env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    try:
        stage = json.loads(Path(path).read_text()).get("zero_optimization", {}).get("stage", 0)
    except (OSError, ValueError, AttributeError):
        stage = None  # reported when the JSON itself is loaded
    for field in fields:
        value = env.get(f"ACCELERATE_DEEPSPEED_{field.upper()}", env.get(f"ACCELERATE_{field.upper()}"))
        if field == "zero_stage" and stage is not None and value is not None and int(value) != int(stage):
            raise ToolkitError(f"{source}: deepspeed_config.zero_stage is {value} but {path} has "
                               f"zero_optimization.stage {stage}; remove zero_stage from the YAML")
        if field == "gradient_accumulation_steps" and value is not None and \
                int(value) != recipe.train.gradient_accumulation_steps:
            raise ToolkitError(f"{source}: deepspeed_config.gradient_accumulation_steps is {value} but the recipe's "
                               f"train.gradient_accumulation_steps is {recipe.train.gradient_accumulation_steps}; "
                               "remove it from the YAML")
        if field != "mixed_precision":
            notes.append(f"{source}: deepspeed_config.{field} not used ({path} and the recipe decide it)")


def worker_env(yaml_path: str, num_processes: int | None = None, extra_args: list[str] = ()) -> dict:
    """The environment `accelerate launch --config_file yaml_path` gives its workers, computed with
    accelerate's own launcher code (nothing is started)."""
    if not Path(yaml_path).is_file():
        raise ToolkitError(f"accelerate config not found: {yaml_path}")
    argv = ["--config_file", str(yaml_path)] + (["--num_processes", str(num_processes)] if num_processes else [])
    argv += list(extra_args)
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    saved = dict(os.environ)
    try:  # the launcher helpers start from os.environ; keep this process's untouched
        args = launch_command_parser().parse_args(argv + ["train.py"])
        args, defaults, mp_from_config = _validate_launch_command(args)
        if args.use_deepspeed and not args.cpu:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mp_from_config)
            _, env = prepare_deepspeed_cmd_env(args)
        elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
            env = prepare_multi_gpu_env(args)
        else:
            _, env = prepare_simple_launcher_cmd_env(args)
    except SystemExit:
        raise ToolkitError(f"{yaml_path}: accelerate cannot read this config") from None
    except Exception as e:  # accelerate's launcher refuses (unknown keys, FP8 or MPI missing, SageMaker)
        raise ToolkitError(f"{yaml_path}: accelerate launch refuses this config on this host: "
                           f"{' '.join(str(e).split())}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {**env, "WORLD_SIZE": str(args.num_processes or 1)}


def plan(recipe: Recipe, env, cuda: bool, source: str = ENV_SOURCE) -> tuple[list[str], dict | None]:
    """What a launch with worker environment `env` would train with: (notes on what is changed,
    the resolved DeepSpeed config or None). Raises ToolkitError for what would be refused."""
    from . import deepspeed_config

    notes: list[str] = []
    check(recipe, env, cuda, source, notes)
    if launch_kind(env) != "deepspeed":
        return notes, None
    world = int(env.get("WORLD_SIZE", "1")) // sequence_parallel_size(env)  # data-parallel ranks
    hidden = deepspeed_config.model_hidden_size(recipe)
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path not in ("", "none"):
        raw, where = deepspeed_config.load_json(path), path
    else:  # inline deepspeed_config settings: accelerate's plugin turns them into a config
        from accelerate.utils import DeepSpeedPlugin

        saved = dict(os.environ)
        try:
            os.environ.update({k: v for k, v in env.items() if k.startswith("ACCELERATE_")})
            raw = DeepSpeedPlugin().deepspeed_config
        finally:
            os.environ.clear()
            os.environ.update(saved)
        where = f"{source} (deepspeed_config)"
    resolved = deepspeed_config.resolve(raw, recipe, world, where, total_steps=recipe.train.max_steps,
                                        hidden_size=hidden, notes=notes)
    return notes, resolved


def show(recipe: Recipe, yaml_path: str, num_processes: int | None, assume_gpu: bool) -> tuple[list[str], str, int]:
    """`toolkit config show --accelerate-config`: (the launch and what is changed, as comment lines; the
    resolved DeepSpeed config with its heading, or ""; the data-parallel ranks)."""
    import json

    import torch

    env = worker_env(yaml_path, num_processes)
    cuda = assume_gpu or torch.cuda.is_available()
    notes, resolved = plan(recipe, env, cuda, source=yaml_path)
    world, sp = int(env.get("WORLD_SIZE", "1")), sequence_parallel_size(env)
    split = f", sequence parallel {sp} ({world // sp} data-parallel rank(s))" if sp > 1 else ""
    lines = [f"# {yaml_path}: {launch_kind(env)}, {world} process(es){split}, {'GPU' if cuda else 'CPU-only host'}"]
    lines += [f"# changed: {note}" for note in dict.fromkeys(notes)] or ["# changed: nothing"]
    ds = ""
    if resolved is not None:
        source = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        source = yaml_path if source in ("", "none") else source
        ds = (f"# {source} resolved for {world // sp} data-parallel rank(s)\n" if sp > 1 else
              f"# {source} resolved for {world} process(es)\n") + json.dumps(resolved, indent=2)
    return lines, ds, world // sp
