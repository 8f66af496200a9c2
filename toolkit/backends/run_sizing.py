"""The memory model (`sizing.py`) applied to a launch and a recipe: the strategy a launch uses, the
setup a recipe makes, the checks a run makes before it loads (a dense model, positions, a sequence
split), and the run's `run: estimate` line."""

from __future__ import annotations

import os

from ..config.methods import method_of
from ..config.objectives import server_arg
from ..errors import ToolkitError, command
from ..optim import optimizers
from . import sequence
from .launch_config import launch_kind, sequence_parallel_size
from .model_counts import count_model, read_config
from .sizing import BY_NAME, GIB, USABLE_FRACTION, Setup, Strategy, estimate, recommend


def launched_strategy(env, ds_config: dict | None) -> Strategy:
    """The row a launch uses, from the environment `accelerate launch` gives its workers and the
    DeepSpeed config (resolved in a run; as written, or the YAML's inline settings, before one)."""
    kind = launch_kind(env)
    if kind == "fsdp":
        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD")
        if reshard is None:
            reshard = str(env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")).upper() not in ("SHARD_GRAD_OP", "2")
        else:
            reshard = reshard.lower() == "true"
        if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
            return BY_NAME["FSDP full-shard + CPU offload"]
        return BY_NAME["FSDP full-shard" if reshard else "FSDP shard-grad-op"]
    if kind != "deepspeed":
        return BY_NAME["DDP"]
    if ds_config is not None:
        zero = ds_config.get("zero_optimization", {}) or {}
        stage = int(zero.get("stage", 0))
        optimizer = (zero.get("offload_optimizer") or {}).get("device", "cpu" if zero.get("cpu_offload") else "none")
        param = (zero.get("offload_param") or {}).get("device", "cpu" if zero.get("cpu_offload_param") else "none")
    else:
        stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))
        optimizer = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        param = env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
    if stage == 3:
        if "nvme" in (optimizer, param):
            return BY_NAME["ZeRO-3 + NVMe params+optimizer"]
        if param == "cpu":
            return BY_NAME["ZeRO-3 + CPU params+optimizer"]
        return BY_NAME["ZeRO-3 + CPU optimizer" if optimizer == "cpu" else "ZeRO-3"]
    if stage == 2:
        return BY_NAME["ZeRO-2 + CPU optimizer" if optimizer in ("cpu", "nvme") else "ZeRO-2"]
    return BY_NAME["ZeRO-1" if stage == 1 else "DDP"]  # ZeRO-0: replicated like DDP


def setup_from_recipe(recipe, **kwargs) -> Setup:
    """The Setup a recipe trains with (model, LoRA, its 4-bit base, precision, micro-batch, sequence length,
    checkpointing, attention, online RL's generation); `kwargs` set the rest (GPUs, memory, the launch's
    sequence parallelism)."""
    config = recipe_config(recipe)
    if recipe.model.tiled_mlp:
        check_dense(config)
    check_positions(recipe, config)
    model = count_model(config, recipe.model.preset or recipe.model.path, recipe.lora)
    method = method_of(recipe)
    pairs = method.pairs  # a pair is two sequences in one forward (KTO's: two apart)
    rl = recipe.rl if method.online else None  # a prompt is num_generations sequences
    per_row = 2 if pairs else rl.num_generations if rl else 1
    rewards, uncounted = reward_model_sizes(rl)
    distill = method.teacher
    teacher = count_model(read_config(rl.teacher, key="rl.teacher"), "rl.teacher") if distill else None
    if rl is not None and not distill and rl.beta > 0 and not recipe.lora.enabled:  # the reference: the base again
        teacher = count_model(config, "the reference (rl.beta > 0, full fine-tuning)")
        kwargs.setdefault("teacher_dtype", recipe.model.dtype)  # the policy's dtype, as TRL's ref_model
    return Setup(model=model, precision=recipe.train.precision, base_dtype=recipe.model.dtype,
                 four_bit=recipe.model.load_in_4bit,
                 micro_batch=recipe.train.micro_batch_size * per_row,
                 seq_len=recipe.data.max_seq_len + (rl.max_new_tokens if rl else 0),
                 gradient_checkpointing=recipe.model.gradient_checkpointing, tiled_mlp=recipe.model.tiled_mlp,
                 optimizer_bytes=optimizers.OPTIMIZERS[recipe.train.optim].state_bytes,
                 activation_offload=recipe.model.activation_offload,
                 attention=recipe.model.attn_implementation, loss=recipe.train.loss,
                 loss_chunk_tokens=recipe.train.loss_chunk_tokens, pairs=pairs,
                 accumulation=recipe.train.gradient_accumulation_steps,
                 **({"generations": rl.num_generations, "new_tokens": rl.max_new_tokens,
                     "reference_forward": rl.beta > 0 and not distill, "iterations": rl.num_iterations,
                     "reward_model_bytes": rewards, "reward_models_uncounted": uncounted, "teacher": teacher,
                     "gathered_sampling": rl.gather_for_sampling, "rloo": method.old_logps, **server_setup(rl)}
                    if rl else {}), **kwargs)


def server_setup(rl) -> dict:
    """rl.sampler vllm: the server samples (its memory is its own), the correction's forward, and the GPU share
    of a server the run starts (--gpu-memory-utilization in rl.vllm_args)."""
    if rl.sampler != "vllm":
        return {}
    share = server_arg(rl.vllm_args, "--gpu-memory-utilization") if rl.vllm_url is None else None
    return {"server_sampling": True, "server_correction": rl.vllm_importance_sampling_correction,
            "server_gpu_share": float(share) if share else 0.0}


def reward_model_sizes(rl) -> tuple[float, tuple]:
    """(the bytes of the weight files of rl.rewards' reward models in local folders, the models not
    counted: a Hub id not in a local folder here)."""
    from pathlib import Path

    total, uncounted = 0.0, []
    for entry in (rl.rewards if rl is not None else []):
        model = getattr(entry, "model", None)
        if model is None:
            continue
        folder = Path(model).expanduser()
        files = [f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern)] if folder.is_dir() else []
        if files:
            total += sum(f.stat().st_size for f in files)
        else:
            uncounted.append(str(model))
    return total, tuple(uncounted)


def check_dense(config) -> None:
    """model.tiled_mlp is refused on a mixture-of-experts model, as the launch refuses it
    (model/activations.tile_mlps), so that `estimate` does not size what cannot run."""
    text = config.get_text_config()
    if getattr(text, "num_local_experts", 0) or getattr(text, "num_experts", 0):
        raise ToolkitError("model.tiled_mlp: for dense models; this one's MLPs are mixture-of-experts layers")


def check_positions(recipe, config) -> None:
    """Online RL: a prompt of up to data.max_seq_len tokens and its completion of up to rl.max_new_tokens
    fit the model's positions (the launch refuses it once the model is built, `estimate` before)."""
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if recipe.model.max_position_embeddings is not None:
        positions = recipe.model.max_position_embeddings
    longest = recipe.data.max_seq_len + recipe.rl.max_new_tokens
    if method_of(recipe).online and positions and longest > positions:
        raise ToolkitError(f"rl.max_new_tokens: a prompt of up to data.max_seq_len={recipe.data.max_seq_len} tokens "
                           f"and a completion of up to rl.max_new_tokens={recipe.rl.max_new_tokens} make {longest:,} "
                           f"positions, more than the model's max_position_embeddings={positions}; lower them (or "
                           "extend the context: model.rope_scaling and model.max_position_embeddings)")


def recipe_config(recipe):
    """The transformers config of the recipe's model (`read_config`), errors naming its key."""
    m = recipe.model
    return read_config(m.preset or m.path, revision=m.revision, key="model.preset" if m.preset else "model.path")


def check_split(recipe, env, source: str) -> None:
    """Refuse, before a launch with worker environment `env`, a sequence-parallel size the recipe's
    model cannot be split by: the launch's own check (`sequence.check_heads`, which
    `DeepSpeed.check_model` asks of the built model), for `toolkit config show`."""
    sp = sequence_parallel_size(env)
    if sp > 1:
        sequence.check_heads(sp, *sequence.attention_heads(recipe_config(recipe)), source)


def size_text(b: float) -> str:
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / 2**20:.1f} MiB"


def estimate_for_run(recipe, accelerator, ds_config: dict | None) -> tuple[str, str | None]:
    """The start-of-run estimate for this launch: (a summary line, a warning when it will not fit).
    Without a CUDA device no memory limit is known: the line gives the per-process bytes only."""
    import torch

    device = accelerator.device
    memory = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    world = accelerator.num_processes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    setup = setup_from_recipe(recipe, gpus_per_node=per_node, nodes=max(1, world // per_node), gpu_memory_gib=memory,
                              sequence_parallel=sequence_parallel_size(os.environ))
    row = estimate(launched_strategy(os.environ, ds_config), setup)
    g = row.gpu
    name = "one process" if world == 1 and row.strategy.name == "DDP" else row.strategy.name
    line = (f"estimate per process ({name}, toolkit estimate): params {size_text(g['params'])}, gradients "
            f"{size_text(g['gradients'])}, optimizer {size_text(g['optimizer'])}, buffers {size_text(g['buffers'])}, "
            f"activations {size_text(g['activations'] + g['logits'])} ({setup.batch_text()})"
            + (f", KV cache {size_text(g['kv_cache'])} ({setup.sampled} completions sampled at once"
               + (f", beside the whole weights gathered for it, {size_text(g['sampling'])}" if g["sampling"] else "")
               + "; freed before training: the larger counts)" if setup.generations and not setup.server_sampling
               else ", sampling on the vLLM server (its memory not counted)" if setup.generations else "")
            + (f", reward models {size_text(g['reward_models'])} (whole on every process)"
               if g["reward_models"] else "") + f" = {size_text(g['total'])}")
    if row.host_per_node:
        line += f"; host RAM {size_text(row.host_per_node)} per node"
    if memory is None:
        return line + f"; no memory limit known on {device.type}", None
    line += f" of {memory:.1f} GiB on {device.type}"
    if row.fits:
        return line, None
    usable = USABLE_FRACTION - setup.server_gpu_share
    return line, (f"the estimate ({size_text(g['total'])} per process) exceeds {usable:.0%} of this GPU's "
                  f"{memory:.1f} GiB: this run will likely run out of memory; "
                  f"`{command('toolkit estimate --recipe ...')}` lists what fits: {recommend(setup)}")
