"""DeepSpeed ZeRO-0/1/2/3, with CPU and NVMe offload, from the user's DeepSpeed JSON (or the
accelerate YAML's inline settings). The prepared model is a DeepSpeed engine: it steps (or skips)
the optimizer inside its backward, keeps fp32 masters of 16-bit weights in its optimizer, and under
ZeRO-3 holds each parameter as a flat partition (`ds_id`, `ds_shape`, `ds_tensor`) that its forward
hooks gather. `deepspeed_config.py` reads and fills the JSON; this file is the run's side of it.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import ToolkitError
from ..optim import build, schedules
from ..storage.verify import read_back, tree_mismatch
from . import deepspeed_config, deepspeed_ops, launch_config, sequence
from .base import MOMENTS, Backend, HostCopies, adam_step, launched_world_size, trained_only

MIN_LOSS_SCALE_ERROR = "Current loss scale already at minimum"


class DeepSpeed(Backend):
    cpu_flag = False  # DeepSpeed runs on its CPU accelerator, over gloo, even as one process

    def __init__(self, kind: str = "deepspeed"):
        super().__init__(kind)
        self.sequence_parallel = launch_config.sequence_parallel_size()  # Ulysses: sequence.py

    def accelerator_options(self, recipe, notes) -> dict:
        if not self.cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ""  # settled by launch_config.check, not refused by accelerate
        # DeepSpeed's batch arithmetic counts data-parallel ranks: the processes over the sequence groups.
        world = launched_world_size() // self.sequence_parallel
        return {"deepspeed_plugin": deepspeed_config.make_plugin(recipe, world, notes)}

    def after_accelerator(self) -> None:
        """accelerate sizes DeepSpeed's train_batch_size by the YAML's dp_shard_size x dp_replicate_size;
        with sequence parallelism the data-parallel ranks are the processes over sp_size (a 4-GPU
        YAML rehearsed on 2 processes would otherwise fail DeepSpeed's batch check). Batches are as
        long as their longest row, so their length is variable."""
        if self.sequence_parallel > 1:
            config = self.accelerator.parallelism_config
            config.dp_replicate_size, config.dp_shard_size = 1, self.data_parallel()[1]
            config.sp_handler.sp_seq_length_is_variable, config.sp_handler.sp_seq_length = True, None

    @property
    def config(self) -> dict:
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @contextmanager
    def sampling(self, model, gather: bool = True):
        """ZeRO-3: every parameter gathered once for the whole sampling, with the engine's forward
        hooks taken off meanwhile (they would release each layer after its forward and gather it again
        for the next token), as TRL's unwrap_model_for_generation does; without `gather`, the module with
        its hooks (TRL's ds3_gather_for_generation=False): a layer at a time, every rank stepping together
        (`sample`'s `synced`). Other stages: as it is."""
        if self.stage != 3 or not gather:
            yield self.accelerator.unwrap_model(model)
            return
        import deepspeed

        offload = model.optimizer.parameter_offload if hasattr(model.optimizer, "parameter_offload") \
            else model.optimizer
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            for p in offload.module.parameters(recurse=True):
                p.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield self.accelerator.unwrap_model(model)
            finally:
                coordinator = getattr(offload, "param_coordinator", None)
                if coordinator is not None and not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()  # the trace of training's forwards, not the sampling's
                offload._register_deepspeed_module(offload.module)

    def check_frozen(self) -> None:
        """ZeRO-3 with parameters offloaded to NVMe: a second model loading under zero.Init would set up its
        swapper in the trained model's swap folder, which DeepSpeed clears first."""
        offload = self.config.get("zero_optimization", {}).get("offload_param") or {}
        if self.stage == 3 and offload.get("device") == "nvme":
            raise ToolkitError("rl.teacher: ZeRO-3 with offload_param on NVMe cannot hold a second model (its "
                               "swapper would clear the student's swapped weights in nvme_path); offload the "
                               "parameters to cpu, or launch without parameter offload")

    def prepare_frozen(self, model):
        """ZeRO-3: an inference engine of its own over the model (loaded partitioned, under the plugin's
        zero.Init), sharded as the trained one with its offload_param, the training-only blocks dropped, as
        TRL's prepare_deepspeed; other stages: a whole copy on every rank."""
        if self.stage != 3:
            return super().prepare_frozen(model)
        import copy

        import deepspeed

        config = copy.deepcopy(self.config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # the engine's eval returns nothing
        return engine

    def frozen_line(self) -> str:
        return "sharded across the ranks (a ZeRO-3 engine of its own)" if self.stage == 3 \
            else "a whole copy on every rank"

    def sampling_line(self, gather: bool = True) -> str:
        if self.stage != 3:
            return "whole weights"
        return ("whole weights gathered once per sampling (ZeRO-3)" if gather else
                "sharded weights, each layer gathered in each token's forward (ZeRO-3, rl.gather_for_sampling false)")

    def check_prepared(self, model) -> None:
        import deepspeed

        if not isinstance(model, deepspeed.DeepSpeedEngine):
            raise ToolkitError("launch: DeepSpeed was configured but the model is not a DeepSpeed engine")
        if hasattr(model.optimizer, "check_grad_overflow"):
            # ZeRO-1/2 check bf16 gradients for inf/NaN only when asked; a non-finite step must
            # be skipped, never applied.
            model.optimizer.check_grad_overflow = True
        if isinstance(model.optimizer, torch.optim.Optimizer) and not hasattr(model.optimizer, "_global_grad_norm"):
            measure_plain_optimizer_steps(model)
        if self.sequence_parallel > 1:
            sequence.follow_rows(model.module.config._attn_implementation)

    def check_model(self, model, recipe) -> None:
        """Ulysses gives each rank of a sequence group a share of the attention heads."""
        if self.sequence_parallel > 1:
            sequence.check_heads(self.sequence_parallel, *sequence.attention_heads(model.config),
                                 launch_config.ENV_SOURCE)

    def check_objective(self, objective) -> None:
        """A loss taken on rows split across a sequence group must be a sum over positions."""
        if self.sequence_parallel > 1 and (why := objective.unsplittable()):
            raise ToolkitError(f"{launch_config.ENV_SOURCE}: parallelism_config_sp_size is {self.sequence_parallel}: "
                               f"{why}; or remove sp_size")

    def check_adapter(self, token_rows: bool) -> None:
        """peft builds the trained token rows of model.add_special_tokens under ZeRO-3 on a CUDA device
        (peft 0.21, `TrainableTokensLayer._collect_token_weights`): refused on a host without CUDA."""
        if token_rows and self.stage == 3 and not self.cuda:
            raise ToolkitError("model.add_special_tokens: with LoRA under ZeRO-3 it needs CUDA (peft builds the "
                               "trained token rows on a CUDA device); on this host use DDP, FSDP or ZeRO-1/2")

    def adapted(self, model) -> None:
        """ZeRO-3 gathers a module's own parameters before its forward; peft's trainable-token layer
        (model.add_special_tokens under LoRA) reads its wrapped layer's weight and its trained rows
        (held by a child ParameterDict) without calling either module, so both are registered as
        the layer's external parameters: its forward and backward gather them. (Marking the layer a
        ZeRO-3 leaf instead breaks on the input embeddings: DeepSpeed's leaf hook fires before the
        trained rows' gradient arrives, since token ids carry no gradient, and gives them a zero
        gradient of the partitioned shape; the GPU check of 2026-11-26 found it.)"""
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

        if self.stage != 3:
            return
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for module in model.modules():
            if isinstance(module, TrainableTokensLayer):
                for p in [*module.get_base_layer().parameters(), *module.trainable_tokens_delta.parameters()]:
                    register_external_parameter(module, p)

    # -- what the run is ---------------------------------------------------------------------------

    def layout(self) -> str:
        split = f", sequence parallel {self.sequence_parallel}" if self.sequence_parallel > 1 else ""
        return f"DeepSpeed ZeRO-{self.stage}{split}"

    # -- sequence parallelism (sequence.py) --------------------------------------------------------

    def data_parallel(self) -> tuple[int, int]:
        sp = self.sequence_parallel
        return self.accelerator.process_index // sp, self.accelerator.num_processes // sp

    def gradient_average(self) -> int:
        """DeepSpeed sums a sequence group's gradients and divides by the data-parallel ranks, except
        where ZeRO-3 reduce-scatters them (`reduce_scatter: true`, forced under sequence parallelism
        in `finalize_config`): DeepSpeed 0.19.8's `__avg_scatter_grads` divides by every rank there,
        so the gradient came out 1/sp_size of one process's (measured: grad norm 1.787 for 3.575;
        seen by others too: deepspeedai/DeepSpeed#6841, hamishivi/tmax#9). A DeepSpeed whose scatter
        takes the split into account is recognised by its source."""
        if self.sequence_parallel > 1 and self.stage == 3 and not zero3_scatter_knows_sequence_parallelism():
            return self.accelerator.num_processes
        return self.data_parallel()[1]

    def shard_sequence(self, batch: dict) -> dict:
        return sequence.shard(batch, self.accelerator.process_index % self.sequence_parallel, self.sequence_parallel)

    def prepare_train_loader(self, loader):
        """Each sequence group loads the same rows: the loader is sharded over the groups."""
        if self.sequence_parallel == 1:
            return super().prepare_train_loader(loader)
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        rank, ranks = self.data_parallel()
        return prepare_data_loader(loader, acc.device, num_processes=ranks, process_index=rank,
                                   split_batches=acc.split_batches, put_on_device=False, rng_types=acc.rng_types.copy(),
                                   dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
                                   use_seedable_sampler=acc.use_seedable_sampler,
                                   data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
                                   use_stateful_dataloader=acc.use_stateful_dataloader)

    def offload(self) -> list[str]:
        zero = self.config.get("zero_optimization", {})
        return [f"{what} to {zero[f'offload_{what}'].get('device')}" for what in ("optimizer", "param")
                if zero.get(f"offload_{what}", {}).get("device", "none") != "none"]

    def resolved_config(self) -> dict | None:
        return self.config

    # -- parameters --------------------------------------------------------------------------------

    def held_numel(self, p) -> int:
        return p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()  # ZeRO-3: this rank's partition

    def materialized_numel(self, p) -> int:
        # ZeRO-3: the partition, and the whole while gathered (a released parameter's data is empty)
        return p.ds_tensor.numel() + p.data.numel() if hasattr(p, "ds_tensor") else p.numel()

    def full_shape(self, p) -> torch.Size:
        return getattr(p, "ds_shape", p.shape)  # ZeRO-3 leaves each rank a flat part

    def partitioned_before_prepare(self, model) -> bool:
        return any(hasattr(p, "ds_id") for p in model.parameters())

    def writable(self, params):
        if not any(hasattr(p, "ds_id") for p in params):
            return super().writable(params)
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0)

    def same_call_count(self, module, n: int, device, most: int | None = None) -> int:
        """ZeRO-3 records the order its modules run in and prefetches by it; a module called a
        different number of times than in the recorded forward invalidates the record, and then it
        gathers the module's weights on every call, in forward and backward (the chunked output
        layer: 8 gathers in forward and 16 in backward per micro-batch instead of 1 and 0, measured
        by tests/head_gathers.py). So where the run's bound is known every forward calls it that
        often, whatever its batch (the extra calls see no rows), with no reduction to agree on it."""
        if most is None or not self.call_is_collective(module):
            return super().same_call_count(module, n, device)
        return max(n, most)

    def call_is_collective(self, module) -> bool:
        return any(hasattr(p, "ds_id") for p in module.parameters())

    def module_of(self, model) -> torch.nn.Module:
        return model.module

    # -- optimizer and schedule --------------------------------------------------------------------

    def make_optimizer(self, params, recipe, model=None):
        """A placeholder when the DeepSpeed JSON brings its own optimizer. (Under optimizer offload
        accelerate swaps in DeepSpeed's CPU Adam for the recipe's AdamW.)"""
        if "optimizer" in self.config:
            from accelerate.utils import DummyOptim

            return DummyOptim(params, lr=recipe.train.learning_rate)
        return super().make_optimizer(params, recipe, model)

    def check_compile(self, recipe) -> None:
        if recipe.train.compile and self.stage == 3:
            raise ToolkitError("train.compile: not supported with DeepSpeed ZeRO-3 (its parameter gathering runs "
                               "inside every compiled layer); set train.compile=false or use ZeRO-1/2 or FSDP")

    def make_scheduler(self, optimizer, recipe, total_steps):
        """A placeholder when the JSON brings its own scheduler; when it brings only an optimizer,
        the recipe's schedule attached to the optimizer DeepSpeed builds (accelerate's
        `lr_scheduler_callable`)."""
        from accelerate.utils import DummyOptim, DummyScheduler

        if "scheduler" in self.config:
            return DummyScheduler(optimizer, total_num_steps=total_steps,
                                  warmup_num_steps=schedules.warmup_steps(recipe.train, total_steps))
        if isinstance(optimizer, DummyOptim):
            return DummyScheduler(optimizer,
                                  lr_scheduler_callable=lambda real: build.schedule(real, recipe.train, total_steps))
        return super().make_scheduler(optimizer, recipe, total_steps)

    def finalize_config(self, model, recipe, total_steps) -> dict:
        """DeepSpeed's "auto" values: bucket sizes from the model, the scheduler's length. An op DeepSpeed is about
        to compile (minutes, the first launch only) is said now, not left as minutes without a line."""
        config = getattr(model, "config", None)
        deepspeed_config.finalize(self.config, recipe, self.data_parallel()[1], total_steps,
                                  getattr(config, "hidden_size", None))
        for op in deepspeed_ops.needed_ops(self.config.get("zero_optimization") or {}, self.config.get("optimizer"),
                                           self.cuda):
            ok, text, _ = deepspeed_ops.op_status(op)
            if ok and "not built" in text:
                self.accelerator.print(f"launch: DeepSpeed compiles its {op} op now, before step 1 (a few minutes, "
                                       "the first launch only: later launches load it)")
        if self.sequence_parallel > 1:  # Ulysses wraps the attention the model runs (varlen for packed rows)
            self.accelerator.parallelism_config.sp_handler.sp_attn_implementation = config._attn_implementation
            zero = self.config.get("zero_optimization", {})
            if self.stage == 3 and zero.get("reduce_scatter", True) is not True:  # one averaging for every bucket
                zero["reduce_scatter"] = True
                self.accelerator.print("launch: zero_optimization.reduce_scatter set to true: under ZeRO-3 with "
                                       "sequence parallelism DeepSpeed averages gradient buckets two ways otherwise")
        return self.config

    def step_was_skipped(self, model) -> bool:
        """The engine has already stepped (or skipped, on a non-finite norm) inside `backward`."""
        return not model.was_step_applied()

    def loss_scale(self, model) -> float | None:
        if self.accelerator.scaler is not None:
            return super().loss_scale(model)
        if model.fp16_enabled():
            optimizer = model.optimizer
            return float(getattr(optimizer, "loss_scale", getattr(optimizer, "cur_scale", float("nan"))))
        return None

    def step_failure(self, error: Exception) -> str | None:
        """DeepSpeed's fp16 loss scaler raises a bare Exception once the scale is at its minimum and
        the gradients still overflow."""
        if MIN_LOSS_SCALE_ERROR in str(error):
            return "fp16 gradients still overflow with the loss scale at its minimum (DeepSpeed fp16.min_loss_scale)"
        return None

    # -- saving ------------------------------------------------------------------------------------

    def trainable_weights(self, model, dtype: torch.dtype | None = None) -> dict:
        if self.stage != 3:
            return super().trainable_weights(model, dtype)
        import deepspeed

        module = self.accelerator.unwrap_model(model)
        out = HostCopies(dtype)
        for n, p in module.named_parameters():  # one tensor whole at a time, on every rank, in the same order
            if p.requires_grad:
                with deepspeed.zero.GatheredParameters([p]):
                    if self.accelerator.is_main_process:
                        out.take(n, p)
        return out.done()

    def full_state_dict(self, model) -> dict:
        """The module's state (ZeRO-3: gathered; None off the main rank), with the fp32 masters in
        place of 16-bit weights: under bf16/fp16 the masters are what was learned, so a bf16 ZeRO
        run saves fp32 weights, as every other backend does."""
        state_dict = super().full_state_dict(model)
        masters = fp32_masters(model)  # a collective too
        if self.accelerator.is_main_process:
            state_dict.update({k: v for k, v in masters.items() if k in state_dict})
        return state_dict

    def save_state(self, model, folder: Path) -> None:
        """The engine's `save_checkpoint` without the frozen parameters, neither in the module's
        state nor as ZeRO-2/3's `frozen_param_fragments` (each rank's part of them). DeepSpeed's own
        exclusion names each parameter once and would keep a frozen tied weight under its other
        name (the output layer beside tied embeddings: 113 MB of SmolLM2-135M in fp32);
        `frozen_left_out` drops every name."""
        with self.frozen_left_out(model):
            self.accelerator.save_state(str(folder), exclude_frozen_parameters=True)

    def saved_state_problem(self, model, optimizer, folder: Path) -> str | None:
        rank = self.accelerator.process_index
        problems = []
        states = folder / "pytorch_model"
        own = states / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        module_file = own if own.is_file() else states / "mp_rank_00_model_states.pt" if rank == 0 else None
        if module_file is not None:
            saved = read_back(module_file)
            live = trained_only(model.module, model.module_state_dict())
            if model.zero_optimization_stage() == 3:
                # ZeRO-3 writes empty placeholders for its partitioned weights (for the persistent
                # small ones too, which are whole again once the save is over); they are in the
                # fp32 partitions of the optimizer files, compared below.
                live = {k: v for k, v in live.items()
                        if not (torch.is_tensor(saved["module"].get(k)) and saved["module"][k].numel() == 0)}
            problems.append(tree_mismatch(saved["module"], live, module_file.name))
            if saved.get("optimizer") is not None:
                problems.append(tree_mismatch(saved["optimizer"], model.optimizer.state_dict(), module_file.name))
        for f in states.glob(f"*zero_pp_rank_{rank}_mp_rank_*_optim_states.pt"):
            saved = read_back(f)["optimizer_state_dict"]
            problems.append(tree_mismatch(saved, model.optimizer.state_dict(), f.name))
        return next((p for p in problems if p), None)

    # -- the portable state ------------------------------------------------------------------------

    def portable_state(self, model, optimizer):
        """With DeepSpeed's own full-state tools (`safe_get_full_fp32_param`,
        `safe_get_full_optimizer_state`): each tensor is a collective, every rank receives it whole,
        only the main process keeps it."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        link_zero12_states(model.optimizer)
        base = model.optimizer.optimizer  # the torch optimizer over ZeRO's fp32 partitions
        weights, moments, adam = {}, {}, []
        for name, p in self.trainable(model):  # same order on every rank
            keys = elementwise_keys(base, getattr(p, "use_muon", False))
            full = safe_get_full_fp32_param(p)
            states = [safe_get_full_optimizer_state(p, key) for key in keys]
            if not self.accelerator.is_main_process:
                continue
            weights[name] = full.detach().float().cpu()
            adam += [name] * ("exp_avg" in keys)
            for key, m in zip(keys, states):
                if m is not None:
                    moments[f"{key}/{name}"] = m.detach().float().cpu()
        step = adam_step(base.state.values(), base.param_groups)
        # the step of each parameter as torch's AdamW keeps it (a tensor), so any backend's AdamW takes it
        scalars = {name: {"step": [True, float(step)]} for name in adam} if step else {}
        return weights, moments, step, self.named_groups(model.module, base.param_groups), scalars

    def set_portable_state(self, model, optimizer, weights, moments, step, by_name, scalars) -> None:
        """`safe_set_full_fp32_param` and `safe_set_full_optimizer_state`, then the 16-bit working
        copies refreshed from the fp32 masters the way DeepSpeed's universal-checkpoint loader does."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero = model.optimizer
        held = {k.split("/", 1)[0] for k in moments}
        takes = {k for muon in (False, True) for k in elementwise_keys(zero.optimizer, muon)}
        if held - takes:
            raise ToolkitError(f"resume: the checkpoint holds optimizer states {sorted(held)} that this launch's "
                               f"optimizer under DeepSpeed ({type(zero.optimizer).__name__}: {sorted(takes)}) cannot "
                               "take; resume under the launch that wrote it")
        # Before its first step ZeRO holds no optimizer state: make it, zeros, for the load to fill.
        flats = (getattr(zero, "single_partition_of_fp32_groups", None)
                 or getattr(zero, "fp32_partitioned_groups_flat", ()))
        group_of = {id(p): g for g in zero.optimizer.param_groups for p in g["params"]}
        for i, flat in enumerate(flats):
            state = zero.optimizer.state[flat]
            keys = elementwise_keys(zero.optimizer, group_of.get(id(flat), {}).get("use_muon", False))
            if keys and keys[0] not in state and held:
                if getattr(zero, "_swappable_optimizer_subgroup", lambda i: False)(i):
                    raise ToolkitError("resume: this launch offloads the optimizer state to NVMe, which a checkpoint "
                                       "of another layout cannot be loaded into; resume under CPU offload or none")
                if "exp_avg" in keys:
                    adam = isinstance(zero.optimizer, (torch.optim.Adam, torch.optim.AdamW))  # torch's: a tensor step
                    state["step"] = torch.tensor(float(step)) if adam else step
                state.update({key: torch.zeros_like(flat) for key in keys})
        link_zero12_states(zero)
        for name, p in self.trainable(model):
            safe_set_full_fp32_param(p, weights[name])
            for key in elementwise_keys(zero.optimizer, getattr(p, "use_muon", False)):
                if f"{key}/{name}" in moments:
                    safe_set_full_optimizer_state(p, moments[f"{key}/{name}"], key)
        base = zero.optimizer
        for st in base.state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(step)) if torch.is_tensor(st["step"]) else step
        for group in base.param_groups:
            if "step" in group:
                group["step"] = step
        # Hyperparameters by group: ZeRO keeps the torch optimizer's groups in the order it was given them.
        for group, ours in zip(base.param_groups, self.named_groups(model.module, base.param_groups)):
            saved = by_name[ours["names"][0]] if ours["names"] else None
            if saved:
                group.update({k: v for k, v in saved.items()
                              if k in ("lr", "initial_lr", "betas", "eps", "weight_decay")})
        if hasattr(zero, "update_lp_params") and not hasattr(zero, "fp16_partitioned_groups_flat"):
            zero.update_lp_params()  # ZeRO-1/2: the working weights from the fp32 masters
        else:  # ZeRO-3: each sub-group's partition from its fp32 master, as DeepSpeed's own loader does
            for i, flat in enumerate(zero.fp16_partitioned_groups_flat):
                if flat is not None and zero.fp32_partitioned_groups_flat[i].numel():
                    flat.data.copy_(zero.fp32_partitioned_groups_flat[i].data)
                    zero._unflatten_partitioned_parameters(i)

    def named_groups(self, module, param_groups) -> list[dict]:
        """The optimizer's groups with parameter names in place of tensors (DeepSpeed's base optimizer
        holds flat partitions: its groups follow the order of the groups it was built from)."""
        built = self.param_groups(module, 0.0)
        if len(built) != len(param_groups):
            raise ToolkitError(f"checkpoint: the optimizer holds {len(param_groups)} parameter groups where the "
                               f"toolkit builds {len(built)}; its portable state cannot name them")
        names = {id(p): n for n, p in module.named_parameters()}
        return [{**{k: v for k, v in g.items() if k != "params"}, "names": [names[id(p)] for p in b["params"]]}
                for g, b in zip(param_groups, built)]


def measure_plain_optimizer_steps(engine) -> None:
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


def fp32_masters(model) -> dict:
    """Under bf16/fp16 the module holds low-precision weights and the optimizer their fp32 master
    copies (partitioned across ranks): gathered (every rank, the same order), by every name a tied
    weight has."""
    if not (model.bfloat16_enabled() or model.fp16_enabled()):
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


def elementwise_keys(base, muon: bool = False) -> tuple[str, ...]:
    """The per-parameter state tensors the optimizer under ZeRO keeps: AdamW's moments (torch's or
    DeepSpeed's own Adam, and the Adam half of DeepSpeed's Muon), SGD's momentum buffer where it has
    momentum, the momentum buffer of a parameter DeepSpeed's Muon steps (`muon`: its use_muon)."""
    if muon:
        return ("momentum_buffer",)
    if isinstance(base, torch.optim.SGD):
        return ("momentum_buffer",) if any(g.get("momentum") for g in base.param_groups) else ()
    return MOMENTS


def link_zero12_states(zero) -> None:
    """ZeRO-1/2 links each parameter to its optimizer-state fragments once, right after the first
    group's first step, so the parameters of every later group are left without (DeepSpeed 0.19:
    `safe_get_full_optimizer_state` then fails with "exp_avg not found"). Link again, now that
    every group has its state."""
    if hasattr(zero, "_hp_optimizer_states_linked") and all(zero.optimizer.state[f] for f in
                                                            zero.single_partition_of_fp32_groups):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def zero3_scatter_knows_sequence_parallelism() -> bool:
    """Whether ZeRO-3's reduce-scatter of gradients divides by the data-parallel ranks under sequence
    parallelism (its other reductions do; DeepSpeed 0.19.8's `__avg_scatter_grads` does not)."""
    import inspect

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    scatter = getattr(DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", None)
    try:
        return scatter is not None and "sequence_parallel_size" in inspect.getsource(scatter)
    except (OSError, TypeError):
        return False
