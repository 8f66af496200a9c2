"""Everything that depends on where tensors live: the one module that knows backend names.

The launch config (`accelerate launch --config_file X.yaml`) picks DDP, FSDP or DeepSpeed; this
module builds the Accelerator for it, works around CPU-host quirks (see
shared/CPU-DISTRIBUTED.md), resolves DeepSpeed's "auto" values from the recipe, checks that
what was prepared is what was launched, and gathers sharded weights for saving. The training
loop calls these helpers and never names a backend.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from pathlib import Path

import torch

from .config import Recipe
from .errors import ToolkitError
from . import deepspeed_config, disk, faults, launch_config
from .stops import TrainingStopped
from .verify import EXIT_SAVE_MISMATCH, blank_like, first_mismatch, inject_corruption, read_back, tree_mismatch

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def launch_kind() -> str:
    """What the launcher asked for, from the environment `accelerate launch` sets."""
    return launch_config.launch_kind(os.environ)


def make_accelerator(recipe: Recipe, recipe_source: str = "recipe"):
    """The Accelerator for this launch, with the recipe's precision and accumulation."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    kind = launch_kind()
    precision = recipe.train.precision
    notes: list[str] = []
    launch_config.check(recipe, os.environ, cuda, notes=notes)
    if kind == "deepspeed" and not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    plugin = None
    if kind == "deepspeed":
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""  # settled by launch_config.check, not refused by accelerate
        plugin = deepspeed_config.make_plugin(recipe, launched_world_size(), notes)
    if kind == "fsdp" and not cuda:
        # Both only matter when ranks load different weights onto a GPU; here they query one and fail.
        os.environ["FSDP_SYNC_MODULE_STATES"] = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    kwargs = dict(
        mixed_precision=MIXED_PRECISION[precision],
        # The loop hands over exactly gradient_accumulation_steps micro-batches per optimizer step.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=recipe.train.gradient_accumulation_steps, sync_with_dataloader=False),
        # The loop steps the scheduler once per applied optimizer step (accelerate would step it
        # num_processes times per step, a schedule built for one process would run N times too fast).
        step_scheduler_with_optimizer=False,
        deepspeed_plugin=plugin,
    )
    if recipe.train.report_to:  # TensorBoard writes into output_dir/tensorboard/
        from accelerate.utils import ProjectConfiguration

        kwargs["log_with"] = list(recipe.train.report_to)
        kwargs["project_config"] = ProjectConfiguration(project_dir=recipe.output_dir,
                                                        logging_dir=str(Path(recipe.output_dir) / "tensorboard"))
    if precision == "fp16":
        from accelerate.utils import GradScalerKwargs

        kwargs["kwargs_handlers"] = [GradScalerKwargs(init_scale=recipe.train.initial_loss_scale)]
    if not cuda:
        # gloo for every backend; DDP on a CPU host also needs cpu=True or each rank trains alone.
        if launched_world_size() > 1 or kind == "deepspeed":
            kwargs.setdefault("kwargs_handlers", []).append(InitProcessGroupKwargs(backend="gloo"))
        if kind in ("ddp", "fsdp", "single"):
            kwargs["cpu"] = True
    accelerator = Accelerator(**kwargs)
    if kind == "fsdp" and accelerator.state.distributed_type.name != "FSDP":
        _force_fsdp_on_cpu(accelerator)
    check_distributed(accelerator)
    if accelerator.is_main_process:
        for note in dict.fromkeys(notes):
            print(f"launch: {note}", file=sys.stderr)
    return accelerator


def check_distributed(accelerator) -> None:
    """Several processes started, but accelerate not distributed: each rank would train alone."""
    started = launched_world_size()
    if started > 1 and (accelerator.num_processes != started or accelerator.distributed_type.name == "NO"):
        raise ToolkitError(
            f"launch: {started} processes were started but accelerate sees {accelerator.num_processes} "
            f"({accelerator.distributed_type.name}); each would train alone. Check the accelerate "
            "config's distributed_type (and drop use_cpu: true)")


def _force_fsdp_on_cpu(accelerator) -> None:
    """accelerate never selects FSDP on a CPU host; FSDP2 itself runs on gloo."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* settings the launcher exported
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

    # Offload copies parameters to the accelerator for compute and fails without one ("Cannot
    # access accelerator device"); on a CPU-only host they are in CPU memory anyway (said in
    # launch_config.check).
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        plugin.cpu_offload = OffloadPolicy()
    elif isinstance(plugin.cpu_offload, CPUOffload) and plugin.cpu_offload.offload_params:
        plugin.cpu_offload = CPUOffload(offload_params=False)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    # Every later AcceleratorState() copies PartialState's fields over its own (accelerate does
    # that inside prepare and save_state), which turned this back into MULTI_CPU: checkpoints then
    # took the unsharded path and failed. So PartialState says FSDP too.
    PartialState().distributed_type = DistributedType.FSDP


def check_prepared(accelerator, model) -> None:
    """Fail loudly if the prepared model is not wrapped the way the launch asked for."""
    kind = launch_kind()
    if kind == "fsdp":
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

        wrapped = isinstance(model, (FSDPModule, FSDP1)) or any(isinstance(m, FSDPModule) for m in model.modules())
        if not wrapped:
            raise ToolkitError("launch: FSDP was configured but the model was not wrapped by FSDP")
    elif kind == "deepspeed":
        import deepspeed

        if not isinstance(model, deepspeed.DeepSpeedEngine):
            raise ToolkitError("launch: DeepSpeed was configured but the model is not a DeepSpeed engine")
        if hasattr(model.optimizer, "check_grad_overflow"):
            # ZeRO-1/2 check bf16 gradients for inf/NaN only when asked; a non-finite step must
            # be skipped, never applied.
            model.optimizer.check_grad_overflow = True
        if isinstance(model.optimizer, torch.optim.Optimizer) and not hasattr(model.optimizer, "_global_grad_norm"):
            _measure_plain_optimizer_steps(model)
    elif kind == "ddp" and accelerator.num_processes > 1:
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ToolkitError("launch: several processes were started but the model is not wrapped for DDP")


def _measure_plain_optimizer_steps(engine) -> None:
    """ZeRO-0 in fp32 steps a plain torch optimizer: DeepSpeed then records no gradient norm (the
    loop saw NaN and stopped a healthy run) and applies a non-finite step. Measure the norm here,
    before DeepSpeed's clipping, and skip the step (DeepSpeed's `overflow`) when it is not finite."""
    optimizer = engine.optimizer
    max_norm = engine.gradient_clipping() or math.inf

    def measure_clip_or_skip(opt, args, kwargs):
        params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
        opt._global_grad_norm, opt.overflow = norm, not math.isfinite(norm)
        if opt.overflow:  # a parameter without a gradient is not updated: the step is skipped
            for p in params:
                p.grad = None

    engine.clip_fp32_gradients = lambda: None  # clipped above, after the norm is measured
    optimizer.register_step_pre_hook(measure_clip_or_skip)


def make_optimizer(accelerator, params: list[dict], recipe: Recipe):
    """AdamW from the recipe, or a placeholder when a DeepSpeed JSON brings its own optimizer."""
    t = recipe.train
    ds = accelerator.state.deepspeed_plugin
    if ds is not None and "optimizer" in ds.deepspeed_config:
        from accelerate.utils import DummyOptim

        return DummyOptim(params, lr=t.learning_rate)
    # On CUDA the fused kernel: one launch for all parameters instead of several per tensor. (Under
    # DeepSpeed optimizer offload accelerate swaps in DeepSpeed's CPU Adam, which ignores it.)
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_epsilon, weight_decay=t.weight_decay,
                             fused=True if accelerator.device.type == "cuda" else None)


def check_compile(accelerator, recipe: Recipe) -> None:
    """train.compile where it is known to work: not under ZeRO-3, whose parameter hooks run inside
    every layer."""
    ds = accelerator.state.deepspeed_plugin
    if recipe.train.compile and ds is not None and ds.deepspeed_config.get("zero_optimization", {}).get("stage") == 3:
        raise ToolkitError("train.compile: not supported with DeepSpeed ZeRO-3 (its parameter gathering runs inside "
                           "every compiled layer); set train.compile=false or use ZeRO-1/2 or FSDP")


def make_scheduler(accelerator, optimizer, lr_lambda, total_steps: int, warmup_steps: int):
    """The recipe's LambdaLR; a placeholder when a DeepSpeed JSON brings its own scheduler; and,
    when the JSON brings only an optimizer, the recipe's schedule attached to the optimizer that
    DeepSpeed builds (accelerate's `lr_scheduler_callable`)."""
    from accelerate.utils import DummyOptim, DummyScheduler

    ds = accelerator.state.deepspeed_plugin
    if ds is not None and "scheduler" in ds.deepspeed_config:
        return DummyScheduler(optimizer, total_num_steps=total_steps, warmup_num_steps=warmup_steps)
    if isinstance(optimizer, DummyOptim):
        return DummyScheduler(optimizer, lr_scheduler_callable=lambda real: torch.optim.lr_scheduler.LambdaLR(real, lr_lambda))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def finalize_config(accelerator, model, recipe: Recipe, total_steps: int) -> dict | None:
    """Fill what depends on the model and the data (DeepSpeed bucket sizes, scheduler length);
    returns the resolved DeepSpeed config, if any (for the run manifest)."""
    ds = accelerator.state.deepspeed_plugin
    if ds is None:
        return None
    config = getattr(model, "config", None)
    deepspeed_config.finalize(ds.deepspeed_config, recipe, accelerator.num_processes, total_steps,
                              getattr(config, "hidden_size", None))
    return ds.deepspeed_config


def optimizer_step(accelerator, model, optimizer, grad_norm: float) -> bool:
    """Apply the optimizer step unless the gradient is not finite; True when it was applied.
    DeepSpeed has already stepped (or skipped, on a non-finite norm) inside `backward`; a loss
    scaler must see every overflow so that it lowers its scale."""
    if math.isfinite(grad_norm) or accelerator.scaler is not None:
        optimizer.step()
    return math.isfinite(grad_norm) and not optimizer_step_was_skipped(accelerator, model)


def loss_scale(accelerator, model) -> float | None:
    """The current dynamic loss scale (fp16), or None when nothing scales the loss."""
    if accelerator.scaler is not None:
        return float(accelerator.scaler.get_scale())
    optimizer = getattr(model, "optimizer", None)  # DeepSpeed engine
    if optimizer is not None and getattr(model, "fp16_enabled", lambda: False)():
        return float(getattr(optimizer, "loss_scale", getattr(optimizer, "cur_scale", float("nan"))))
    return None


def optimizer_step_was_skipped(accelerator, model) -> bool:
    """True when the last optimizer step was skipped (fp16 overflow): no scheduler step then."""
    if hasattr(model, "was_step_applied"):  # DeepSpeed engine
        return not model.was_step_applied()
    return bool(accelerator.optimizer_step_was_skipped)


def checkpoint_layout(accelerator) -> str:
    """How this launch lays the training state out on disk; a checkpoint loads only into the layout
    that wrote it (another ZeRO stage, FSDP instead of ZeRO, or a sharded instead of a full state
    dict each fail deep inside the backend's loader)."""
    kind = launch_kind()
    if kind == "deepspeed":
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        return f"DeepSpeed ZeRO-{zero.get('stage', 0)}"
    if kind == "fsdp":
        plugin = accelerator.state.fsdp_plugin
        kind_of_state = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)
        return f"FSDP{getattr(plugin, 'fsdp_version', 1)} {kind_of_state}"
    return "DDP" if kind == "ddp" else "single process"


def describe(accelerator) -> str:
    """The backend in force, for the start-of-run summary."""
    layout = checkpoint_layout(accelerator)
    n = accelerator.num_processes
    extra = ""
    ds = accelerator.state.deepspeed_plugin
    if ds is not None:
        zero = ds.deepspeed_config.get("zero_optimization", {})
        offload = [f"{what} to {zero[f'offload_{what}'].get('device')}" for what in ("optimizer", "param")
                   if zero.get(f"offload_{what}", {}).get("device", "none") != "none"]
        extra = f" (offload {', '.join(offload)})" if offload else ""
    if n == 1 and layout == "single process":
        return f"single process on {accelerator.device.type}"
    return f"{layout}{extra}, {n} process{'es' if n > 1 else ''} on {accelerator.device.type}"


MIN_LOSS_SCALE_ERROR = "Current loss scale already at minimum"


def step_failure(error: Exception) -> str | None:
    """A backend's way of saying training cannot go on, as one line (None: a genuine bug).
    DeepSpeed's fp16 loss scaler raises a bare Exception once the scale is at its minimum and the
    gradients still overflow."""
    if MIN_LOSS_SCALE_ERROR in str(error):
        return "fp16 gradients still overflow with the loss scale at its minimum (DeepSpeed fp16.min_loss_scale)"
    return None


def save_model(accelerator, model, tokenizer, path: Path, extra_files: dict[str, str] | None = None) -> None:
    """Gather shards (ZeRO-3, FSDP) and save once, in Hugging Face format, from the main process.
    Written to a temporary folder, read back and compared with the gathered weights, then renamed,
    so `path` is either complete and verified or absent (a mismatch stops every rank in one line,
    with the folder left as `<path>.tmp` and an earlier `path` untouched)."""
    state_dict = accelerator.get_state_dict(model) or {}  # a collective; ZeRO-3 returns None off the main rank
    # FSDP with a sharded state-dict type hands back DTensor shards: gather each (all ranks, same order).
    state_dict = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict.items()}
    masters = deepspeed_fp32_masters(model)  # a collective too
    if accelerator.is_main_process:
        state_dict.update({k: v for k, v in masters.items() if k in state_dict})
        # Own, contiguous CPU copies: gathered FSDP tensors may not own valid storage.
        state_dict = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
        tmp = path.with_name(path.name + ".tmp")
        needed = sum(v.numel() * v.element_size() for v in state_dict.values())
        with disk.writing("final save", tmp, needed):
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            unwrapped = accelerator.unwrap_model(model)
            if hasattr(unwrapped, "peft_config"):  # peft keeps only the adapter's tensors
                from peft.utils import get_peft_model_state_dict

                unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                expected = get_peft_model_state_dict(unwrapped, state_dict=state_dict)
            else:
                expected = state_dict
                # Not transformers' save_pretrained: on a sharded model it tries to gather again, as a
                # collective, from the main process alone.
                from huggingface_hub import save_torch_state_dict

                tmp.mkdir(parents=True)
                unwrapped.config.save_pretrained(tmp)
                if getattr(unwrapped, "generation_config", None) is not None:
                    unwrapped.generation_config.save_pretrained(tmp)
                save_torch_state_dict(state_dict, tmp, max_shard_size="5GB")
            tokenizer.save_pretrained(tmp)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            inject_corruption(tmp)
            faults.at("final")
            problem = first_mismatch(tmp, expected)
            if problem is None:
                disk.replace_dir(tmp, path)  # may exist: a resumed run that had already saved it before being killed
    verdict = [problem if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(verdict)  # every rank stops, or none does
    accelerator.wait_for_everyone()
    if verdict[0] is not None:
        raise TrainingStopped(f"{verdict[0]}; the save did not read back as trained, so {path.name}/ was not "
                              f"written (checkpoints are intact)", EXIT_SAVE_MISMATCH)


def checkpoint_problem(accelerator, model, optimizer, folder: Path) -> str | None:
    """Read back this rank's share of a checkpoint that `accelerator.save_state` just wrote and
    compare it with the live state it came from: the weights (or adapter, and for ZeRO the fp32
    partitions) and the optimizer state. None when equal; else one line naming the file and the
    first tensor that differs. Every rank calls it (the sharded FSDP read is a collective)."""
    rank = accelerator.process_index
    try:
        if hasattr(model, "zero_optimization_stage"):  # DeepSpeed engine
            problems = []
            states = folder / "pytorch_model"
            own = states / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            module_file = own if own.is_file() else states / "mp_rank_00_model_states.pt" if rank == 0 else None
            if module_file is not None:
                saved = read_back(module_file)
                live = model.module_state_dict()
                if model.zero_optimization_stage() == 3:
                    # ZeRO-3 writes empty placeholders for its partitioned weights (for the persistent
                    # small ones too, which are whole again once the save is over); they are in the
                    # fp32 partitions of the optimizer files, compared below.
                    live = {k: v for k, v in live.items()
                            if not (torch.is_tensor(saved["module"].get(k)) and saved["module"][k].numel() == 0)}
                problems.append(tree_mismatch(saved["module"], live, module_file.name))
                if saved.get("frozen_param_fragments"):  # frozen (LoRA base) weights: this rank's part
                    frozen = {n: p.ds_tensor if hasattr(p, "ds_id") else p
                              for n, p in model.module.named_parameters() if not p.requires_grad}
                    problems.append(tree_mismatch(saved["frozen_param_fragments"], frozen, module_file.name))
                if saved.get("optimizer") is not None:
                    problems.append(tree_mismatch(saved["optimizer"], model.optimizer.state_dict(), module_file.name))
            for f in states.glob(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt"):
                saved = read_back(f)["optimizer_state_dict"]
                problems.append(tree_mismatch(saved, model.optimizer.state_dict(), f.name))
            return next((p for p in problems if p), None)
        if launch_kind() == "fsdp":
            return _fsdp_checkpoint_problem(accelerator, accelerator.state.fsdp_plugin, model, optimizer, folder)
        if rank != 0:
            return None
        weights = accelerator.unwrap_model(model).state_dict()
        return (first_mismatch(folder, weights) if any(folder.glob("*.safetensors"))
                else tree_mismatch(read_back(folder / "pytorch_model.bin"), weights, "pytorch_model.bin")) \
            or tree_mismatch(read_back(folder / "optimizer.bin"), optimizer.state_dict(), "optimizer.bin")
    except Exception as e:  # a file that cannot be read back is a failed save, said in one line
        return f"{folder}: could not be read back ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _fsdp_checkpoint_problem(accelerator, plugin, model, optimizer, folder: Path) -> str | None:
    """FSDP: the state dicts accelerate saved, rebuilt from the live model the way it built them;
    a sharded checkpoint is loaded (torch.distributed.checkpoint) into empty copies of this
    rank's shards, a full one compared on the main process."""
    from contextlib import nullcontext

    import torch.distributed.checkpoint as dcp
    from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options  # what save_state uses
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1, StateDictType

    options = _prepare_sd_options(plugin)
    ctx = (FSDP1.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config)
           if plugin.fsdp_version == 1 else nullcontext())
    with ctx:
        weights = _get_model_state_dict(model, sd_options=options)
        if plugin.fsdp_version == 2:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            optim = get_optimizer_state_dict(model, optimizer, options=options)
        else:
            optim = FSDP1.optim_state_dict(model, optimizer)
    if plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
        if accelerator.process_index != 0:
            return None
        return (tree_mismatch(read_back(folder / "pytorch_model_fsdp.bin"), weights, "pytorch_model_fsdp.bin")
                or tree_mismatch(read_back(folder / "optimizer.bin"), optim, "optimizer.bin"))
    problems = []
    for key, live, sub in (("model", weights, "pytorch_model_fsdp_0"), ("optimizer", optim, "optimizer_0")):
        scratch = {key: blank_like(live)}
        dcp.load(scratch, checkpoint_id=str(folder / sub))
        problems.append(tree_mismatch(scratch[key], live, sub))
    return next((p for p in problems if p), None)


def deepspeed_fp32_masters(model) -> dict:
    """Under DeepSpeed bf16/fp16 the module holds low-precision weights and the optimizer their
    fp32 master copies (partitioned across ranks). The masters are what was learned: gather them
    (every rank, the same order) so a bf16 ZeRO run saves fp32 weights, as every other backend does."""
    if not hasattr(model, "bfloat16_enabled") or not (model.bfloat16_enabled() or model.fp16_enabled()):
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    names: dict[int, list[str]] = {}
    for name, p in model.module.named_parameters(remove_duplicate=False):  # tied weights: several names
        names.setdefault(id(p), []).append(name)
    masters = {}
    for _, p in model.module.named_parameters():
        if not p.requires_grad:
            continue
        full = safe_get_full_fp32_param(p)
        if full is not None:
            for name in names[id(p)]:
                masters[name] = full.detach().to("cpu", copy=True)
    return masters


def teardown(accelerator) -> None:
    """Release engines and the process group; some ZeRO-3 offload runs abort at exit otherwise."""
    accelerator.free_memory()
    end_process_group()


def end_process_group() -> None:
    """Destroy the process group so that its threads end before the interpreter does. A gloo
    worker thread still releasing a finished collective's tensors when Python finalizes must take
    the GIL for it; the interpreter ends that thread inside a C++ destructor and the process aborts
    ("terminate called without an active exception", seen in 1 of 5 two-process runs under load).
    The group lives as long as anything refers to it, and a DDP module sits in reference cycles
    that only a collection frees: collect first, so that destroying it joins its threads."""
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()


def same_call_count(module: torch.nn.Module, n: int, device) -> int:
    """How often to call `module` in this forward when this rank needs `n` calls. Where a call is
    a collective (ZeRO-3 gathers a partitioned layer's parameters in its forward hooks; FSDP
    unshards a module it wraps on its own), every rank must call it equally often: the most any
    rank needs. Elsewhere `n`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    collective = any(hasattr(p, "ds_id") for p in module.parameters()) or any(
        isinstance(m, (FSDPModule, FSDP1)) for m in module.modules())
    if not collective:
        return n
    most = torch.tensor(n, device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    return int(most)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only, never norms or biases (by the full shape: ZeRO-3 leaves each rank a flat part)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [{"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay},
              {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # DeepSpeed fails on an empty group (LoRA has no 1-D params)
