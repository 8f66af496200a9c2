"""`Backend`: one process, and the defaults every other backend starts from.

A method here is either the same for every backend (building the Accelerator, the optimizer step,
saving `final/`) with a hook a subclass fills, or this backend's version of an operation that
`ddp.py`, `fsdp.py` or `deepspeed.py` replace.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from .. import faults
from ..config import Recipe
from ..errors import EXIT_SAVE_MISMATCH, ToolkitError
from ..optim import build
from ..stops import TrainingStopped
from ..storage import disk
from ..storage.portable import flat_state, host_state, state_by_name
from ..storage.verify import first_mismatch, inject_corruption, read_back, tree_mismatch
from . import launch_config

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, by the names torch and DeepSpeed both use


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def host_copy(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor's own copy on the host, cast first (on its device) where `dtype` is given."""
    p = p.detach() if dtype is None else p.detach().to(dtype)
    return p.to("cpu", copy=True)


class HostCopies(dict):
    """Host copies taken between gathers: the first failure is kept and raised by `done` once every gather (a
    collective) has run."""

    def __init__(self, dtype: torch.dtype | None):
        super().__init__()
        self.dtype, self.failure = dtype, None

    def take(self, name: str, p: torch.Tensor) -> None:
        if self.failure is None:
            try:
                self[name] = host_copy(p, self.dtype)
            except Exception as err:  # noqa: BLE001 - out of host memory, mostly: raised after the gathers
                self.failure = err

    def done(self) -> dict:
        if self.failure is not None:
            raise self.failure
        return dict(self)


class Backend:
    """One process (no launcher, or a launch of one process without FSDP or DeepSpeed)."""

    cpu_flag = True  # accelerate's `cpu=True` on a CPU host (DDP trains each rank alone without it)

    def __init__(self, kind: str = "single"):
        self.kind = kind  # as launch_config.launch_kind says: single, ddp, fsdp, deepspeed
        self.cuda = torch.cuda.is_available()
        self.accelerator = None
        self.group_lrs: dict | None = None  # parameters at another learning rate than the recipe's (param_groups)

    # -- the Accelerator -------------------------------------------------------------------------

    def make_accelerator(self, recipe: Recipe, recipe_source: str = "recipe"):
        """The Accelerator for this launch, with the recipe's precision and accumulation."""
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

        precision = recipe.train.precision
        notes: list[str] = []
        launch_config.check(recipe, os.environ, self.cuda, notes=notes)
        kwargs = dict(
            # mixed_precision: fp8 in the launch passed check() above only with train.precision=bf16
            mixed_precision="fp8" if launch_config.fp8() else MIXED_PRECISION[precision],
            # The loop hands over exactly gradient_accumulation_steps micro-batches per optimizer step.
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=recipe.train.gradient_accumulation_steps, sync_with_dataloader=False),
            # The loop steps the scheduler once per applied optimizer step (accelerate would step it
            # num_processes times per step, a schedule built for one process would run N times too fast).
            step_scheduler_with_optimizer=False,
            **self.accelerator_options(recipe, notes),
        )
        if recipe.train.report_to:  # TensorBoard writes into output_dir/tensorboard/
            from accelerate.utils import ProjectConfiguration

            kwargs["log_with"] = list(recipe.train.report_to)
            kwargs["project_config"] = ProjectConfiguration(project_dir=recipe.output_dir,
                                                            logging_dir=str(Path(recipe.output_dir) / "tensorboard"))
        if precision == "fp16":
            from accelerate.utils import GradScalerKwargs

            kwargs["kwargs_handlers"] = [GradScalerKwargs(init_scale=recipe.train.initial_loss_scale)]
        if not self.cuda:
            # gloo for every backend; DDP on a CPU host also needs cpu=True or each rank trains alone.
            if launched_world_size() > 1 or not self.cpu_flag:
                kwargs.setdefault("kwargs_handlers", []).append(InitProcessGroupKwargs(backend="gloo"))
            if self.cpu_flag:
                kwargs["cpu"] = True
        self.accelerator = Accelerator(**kwargs)
        self.after_accelerator()
        self.check_distributed()
        if self.accelerator.is_main_process:
            for note in dict.fromkeys(notes):
                print(f"launch: {note}", file=sys.stderr)
        return self.accelerator

    def accelerator_options(self, recipe: Recipe, notes: list[str]) -> dict:
        """Further Accelerator arguments (and environment) this backend needs."""
        return {}

    def after_accelerator(self) -> None:
        """Fix what accelerate set up differently from what was launched."""

    def check_adapter(self, token_rows: bool) -> None:
        """Refuse, in one line, a LoRA adapter this backend cannot train here (before it is built)."""

    def adapted(self, model) -> None:
        """What this backend needs to know of a LoRA-adapted model before it is prepared."""

    def check_model(self, model, recipe: Recipe) -> None:
        """Refuse, in one line, a model this launch cannot train (right after it is built)."""

    def check_objective(self, objective) -> None:
        """Refuse an objective this launch cannot train (its `unsplittable()` reason, say)."""

    def check_distributed(self) -> None:
        """Several processes started, but accelerate not distributed: each rank would train alone."""
        started, accelerator = launched_world_size(), self.accelerator
        if started > 1 and (accelerator.num_processes != started or accelerator.distributed_type.name == "NO"):
            raise ToolkitError(
                f"launch: {started} processes were started but accelerate sees {accelerator.num_processes} "
                f"({accelerator.distributed_type.name}); each would train alone. Check the accelerate "
                "config's distributed_type (and drop use_cpu: true)")

    def check_prepared(self, model) -> None:
        """Fail loudly if the prepared model is not wrapped the way the launch asked for."""

    def teardown(self) -> None:
        """Release engines and the process group; some ZeRO-3 offload runs abort at exit otherwise.
        Without a process group (one plain process) there is nothing to release before exit, and the
        collections would cost 0.6 s of every run."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        self.accelerator.free_memory()
        end_process_group()

    # -- what the run is ---------------------------------------------------------------------------

    sequence_parallel = 1  # the ranks each sequence is split across (sequence.py)

    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, how many there are): the ranks that see different rows."""
        return self.accelerator.process_index, self.accelerator.num_processes

    def gradient_average(self) -> int:
        """How many ranks the backend divides the summed gradients by (the loop's loss scale undoes it)."""
        return self.accelerator.num_processes

    def shard_sequence(self, batch: dict) -> dict:
        """This rank's part of a collated batch (the whole batch unless sequences are split)."""
        return batch

    def prepare_train_loader(self, loader):
        """The training DataLoader, sharded over the data-parallel ranks; the loop moves batches itself."""
        return self.accelerator.prepare_data_loader(loader, device_placement=False)

    def layout(self) -> str:
        """How this launch lays the training state out on disk; a checkpoint loads only into the
        layout that wrote it (another ZeRO stage, FSDP instead of ZeRO, or a sharded instead of a
        full state dict each fail deep inside the backend's loader)."""
        return "single process"

    def offload(self) -> list[str]:
        """What is offloaded, for the start-of-run line ("optimizer to cpu")."""
        return []

    def describe(self) -> str:
        """The backend in force, for the start-of-run summary."""
        n, device = self.accelerator.num_processes, self.accelerator.device.type
        if n == 1 and self.kind == "single":
            return f"single process on {device}"
        offload = self.offload()
        extra = f" (offload {', '.join(offload)})" if offload else ""
        return f"{self.layout()}{extra}, {n} process{'es' if n > 1 else ''} on {device}"

    def resolved_config(self) -> dict | None:
        """The backend's own config as resolved for this run (DeepSpeed's JSON), for the manifest."""
        return None

    @contextmanager
    def sampling(self, model, gather: bool = True):
        """The module online RL samples completions from (`model/sampling.py`), token by token. By
        default the module as it is: whole weights (one process, DDP). A backend that shards the
        weights gathers them once for the whole sampling here, not per layer per token; with `gather`
        false (rl.gather_for_sampling) each forward gathers a layer at a time and frees it, as in training."""
        yield self.accelerator.unwrap_model(model)

    def sampling_line(self, gather: bool = True) -> str:
        """How `sampling` holds the weights, for the start-of-run line of online RL."""
        return "whole weights"

    def materialized_numel(self, p: torch.nn.Parameter) -> int:
        """The elements of a parameter this rank holds right now: its shard, and the whole while gathered."""
        return self.held_numel(p)

    def check_frozen(self) -> None:
        """Refuse, in one line, a second frozen model (distillation's teacher) this launch cannot hold, before
        it loads."""

    def prepare_frozen(self, model):
        """A second model that only runs forwards (distillation's teacher), frozen, in eval mode, held as this
        backend holds such a model (TRL's prepare_deepspeed / prepare_model(evaluation_mode=True)): here a whole
        copy on this process's device. Call it after the trained model is prepared."""
        model.requires_grad_(False)
        return model.to(self.accelerator.device).eval()

    def frozen_line(self) -> str:
        """How `prepare_frozen` holds a model, for the start-of-run line."""
        return "a whole copy on every rank"

    # -- parameters --------------------------------------------------------------------------------

    def held_numel(self, p: torch.nn.Parameter) -> int:
        """The elements of a parameter this rank holds (an FSDP2 shard is a DTensor's local part)."""
        return p.to_local().numel() if hasattr(p, "to_local") else p.numel()

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """A parameter's shape in the model (a partitioned one is a flat part of it on each rank)."""
        return p.shape

    def param_groups(self, model: torch.nn.Module, weight_decay: float, lrs: dict | None = None) -> list[dict]:
        """Decay matrices only, never norms or biases (by the full shape). `lrs`: the learning rate of each
        parameter, by name, that trains at another rate than the recipe's (LoRA+'s B matrices, embeddings;
        optim.optimizers.learning_rates), a group for each rate; kept for `named_groups` to rebuild the same."""
        self.group_lrs = lrs = self.group_lrs if lrs is None else lrs
        keyed: dict[tuple, list] = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                keyed.setdefault((len(self.full_shape(p)) < 2, (lrs or {}).get(name, -1.0)), []).append(p)
        groups = []
        for (vector, lr), params in sorted(keyed.items()):  # matrices first, the recipe's rate first
            groups.append({"params": params, "weight_decay": 0.0 if vector else weight_decay,
                           **({"lr": lr} if lr >= 0 else {})})
        return groups  # never an empty one: DeepSpeed fails on it (LoRA has no 1-D params)

    def partitioned_before_prepare(self, model: torch.nn.Module) -> bool:
        """Whether the freshly built model holds placeholders instead of its weights (ZeRO-3's zero.Init)."""
        return False

    def writable(self, params: list[torch.nn.Parameter]):
        """A context in which the freshly built model's `params` hold their whole values and what is
        written into them stays (ZeRO-3 gathers them and keeps the first rank's writes)."""
        return nullcontext()

    def same_call_count(self, module: torch.nn.Module, n: int, device, most: int | None = None) -> int:
        """How often to call `module` in this forward when this rank needs `n` calls (and no forward
        of this run needs more than `most`, where known). Where a call is a collective (ZeRO-3
        gathers a partitioned layer's parameters in its forward hooks; FSDP unshards a module it
        wraps on its own), every rank must call it equally often: the most any rank needs. Elsewhere `n`."""
        if not self.call_is_collective(module):
            return n
        most = torch.tensor(n, device=device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most)

    def call_is_collective(self, module: torch.nn.Module) -> bool:
        return False

    # -- optimizer and schedule --------------------------------------------------------------------

    def make_optimizer(self, params: list[dict], recipe: Recipe, model: torch.nn.Module | None = None):
        """train.optim over the parameter groups `params` (optim/optimizers.py): adamw_torch is the fused
        kernel on CUDA, one launch for all parameters instead of several per tensor."""
        t = recipe.train
        return build.make(t.optim, params, t, self.accelerator.device, model, t.optim_args)

    def check_compile(self, recipe: Recipe) -> None:
        """Refuse train.compile where it is known not to work."""

    def make_scheduler(self, optimizer, recipe: Recipe, total_steps: int):
        """train.lr_scheduler_type over `total_steps` (optim/schedules.py)."""
        return build.schedule(optimizer, recipe.train, total_steps)

    def finalize_config(self, model, recipe: Recipe, total_steps: int) -> dict | None:
        """Fill what depends on the model and the data; returns the resolved backend config, if any
        (for the run manifest)."""
        return None

    def optimizer_step(self, model, optimizer, grad_norm: float) -> bool:
        """Apply the optimizer step unless the gradient is not finite; True when it was applied. A
        loss scaler must see every overflow so that it lowers its scale."""
        if math.isfinite(grad_norm) or self.accelerator.scaler is not None:
            optimizer.step()
        return math.isfinite(grad_norm) and not self.step_was_skipped(model)

    def step_was_skipped(self, model) -> bool:
        """True when the last optimizer step was skipped (fp16 overflow): no scheduler step then."""
        return bool(self.accelerator.optimizer_step_was_skipped)

    def loss_scale(self, model) -> float | None:
        """The current dynamic loss scale (fp16), or None when nothing scales the loss."""
        if self.accelerator.scaler is not None:
            return float(self.accelerator.scaler.get_scale())
        return None

    def step_failure(self, error: Exception) -> str | None:
        """The backend's way of saying training cannot go on, as one line (None: a genuine bug)."""
        return None

    # -- saving ------------------------------------------------------------------------------------

    def trainable_weights(self, model, dtype: torch.dtype | None = None) -> dict:
        """The trainable parameters (a LoRA adapter's, or every trained weight) by name, whole, on the host of the
        main process only, in `dtype` if given (cast on the device first); empty elsewhere (a collective: every
        rank calls it). Nothing else is gathered, and a sharded backend gathers one tensor at a time; a host copy
        that fails on the main process is raised there after the last gather (`HostCopies`), so no rank is left
        waiting in one."""
        if not self.accelerator.is_main_process:
            return {}
        module = self.accelerator.unwrap_model(model)
        return {n: host_copy(p, dtype) for n, p in module.named_parameters() if p.requires_grad}

    def full_state_dict(self, model) -> dict:
        """The model's whole state dict, complete on the main process (a collective: every rank
        calls it; other ranks may get an empty dict)."""
        return self.accelerator.get_state_dict(model) or {}

    def save_model(self, model, tokenizer, path: Path, extra_files: dict[str, str] | None = None) -> None:
        """Gather shards (ZeRO-3, FSDP) and save once, in Hugging Face format, from the main process.
        Written to a temporary folder, read back and compared with the gathered weights, then renamed,
        so `path` is either complete and verified or absent (a mismatch stops every rank in one line,
        with the folder left as `<path>.tmp` and an earlier `path` untouched)."""
        accelerator = self.accelerator
        state_dict = self.full_state_dict(model)
        problem = None
        if accelerator.is_main_process:
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
                    # Not transformers' save_pretrained: on a sharded model it tries to gather again, as
                    # a collective, from the main process alone.
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
                    # may exist: a resumed run that had already saved it before being killed
                    disk.replace_dir(tmp, path)
        verdict = [problem]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(verdict)  # every rank stops, or none does
        accelerator.wait_for_everyone()
        if verdict[0] is not None:
            raise TrainingStopped(f"{verdict[0]}; the save did not read back as trained, so {path.name}/ was not "
                                  f"written (checkpoints are intact)", EXIT_SAVE_MISMATCH)

    def save_state(self, model, folder: Path) -> None:
        """accelerate's `save_state` into `folder`, with what is trained of the model: its frozen
        weights (a LoRA adapter's base) are left out, as from the portable state, since a resume
        builds them again from the recipe (SmolLM2-135M with a 10 MB adapter: 597 MB a checkpoint
        before, 59 MB after; tests/test_checkpoint_size.py)."""
        with self.frozen_left_out(model):
            self.accelerator.save_state(str(folder))

    def load_state(self, model, folder: Path) -> None:
        """Restore what `save_state` wrote (or an older checkpoint, which holds the whole model),
        strictly but for the frozen weights: the recipe's, already in the model."""
        with self.frozen_left_out(model):
            self.accelerator.load_state(str(folder))

    def frozen_left_out(self, model):
        """While a checkpoint is written or loaded: the state dict of the module accelerate (or the
        engine) saves leaves the frozen parameters out, and one without them loads strictly."""
        return leaving_frozen_out(self.module_of(model))

    def checkpoint_problem(self, model, optimizer, folder: Path) -> str | None:
        """Read back this rank's share of a checkpoint that `save_state` just wrote and
        compare it with the live state it came from: the weights (or adapter, and for ZeRO the fp32
        partitions) and the optimizer state. None when equal; else one line naming the file and the
        first tensor that differs. Every rank calls it (the sharded FSDP read is a collective)."""
        try:
            return self.saved_state_problem(model, optimizer, Path(folder))
        except Exception as e:  # a file that cannot be read back is a failed save, said in one line
            return f"{folder}: could not be read back ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"

    def saved_state_problem(self, model, optimizer, folder: Path) -> str | None:
        """`checkpoint_problem` for this backend's files (may raise on an unreadable file)."""
        if self.accelerator.process_index != 0:
            return None
        weights = trained_only(self.module_of(model), self.module_of(model).state_dict())
        return (first_mismatch(folder, weights) if any(folder.glob("*.safetensors"))
                else tree_mismatch(read_back(folder / "pytorch_model.bin"), weights, "pytorch_model.bin")) \
            or tree_mismatch(read_back(folder / "optimizer.bin"), optimizer.state_dict(), "optimizer.bin")

    # -- the portable state (portable.py writes and checks the files) --------------------------------

    def trainable(self, model) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters by the model's own names (peft's for an adapter), each once."""
        seen, out = set(), []
        for name, p in self.module_of(model).named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def module_of(self, model) -> torch.nn.Module:
        """The model as built, inside what prepare wrapped it in."""
        return self.accelerator.unwrap_model(model)

    def portable_state(self, model, optimizer) -> tuple[dict, dict, int, list[dict], dict]:
        """(weights, moments, step, groups, scalars) of the trainable parameters, tensors complete on the
        main process, on the CPU (floating ones in fp32): `moments` every per-parameter state tensor of
        the optimizer keyed `KEY/NAME` (AdamW's exp_avg and exp_avg_sq, SGD's momentum_buffer, Adafactor's
        factored rows and columns, bitsandbytes' 8-bit states with their absmax and qmap), `scalars` the
        rest of each parameter's state by name (`[is a tensor, value]`: the step), `step` the optimizer's
        step count, each group its hyperparameters and `names`. A collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        names = dict(self.trainable(model))
        full = get_model_state_dict(model, options=_full_options())
        weights = {k: v.detach().float().cpu().contiguous() for k, v in full.items() if k in names}
        osd = get_optimizer_state_dict(model, optimizer, options=_full_options())
        moments, scalars, held = {}, {}, set()
        for name in names if self.accelerator.is_main_process else ():  # cpu_offload: the full state on rank 0 only
            for key, value in flat_state(osd.get("state", {}).get(name, {})).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    copy = host_state(value)
                    if copy.data_ptr() in held:  # one tensor in several states (bitsandbytes' qmap): a file holds each
                        copy = copy.clone()
                    held.add(copy.data_ptr())
                    moments[f"{key}/{name}"] = copy
                elif value is not None:
                    scalars.setdefault(name, {})[key] = [torch.is_tensor(value),
                                                         value.item() if torch.is_tensor(value) else value]
        step = adam_step(osd.get("state", {}).values(), osd.get("param_groups", []))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "names": list(g["params"])}
                  for g in osd.get("param_groups", [])]
        return weights, moments, step, groups, scalars

    def set_portable_state(self, model, optimizer, weights: dict, moments: dict, step: int, by_name: dict,
                           scalars: dict | None) -> None:
        """Set the prepared model and optimizer from a portable state (`by_name`: each parameter's
        saved group; `scalars` None: a checkpoint of before per-optimizer states, AdamW's moments and
        one step count)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # Copies: the state-dict API renames keys of the dicts it is given in place (DDP's `module.`).
        set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True, strict=False))
        current = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        for group in current["param_groups"]:
            saved = by_name[group["params"][0]]
            group.update({k: v for k, v in saved.items() if k not in ("names", "params")})
        current["state"] = state_by_name(weights, moments, step, scalars)
        set_optimizer_state_dict(model, optimizer, dict(current), options=StateDictOptions(full_state_dict=True))


def trained_only(module: torch.nn.Module, state_dict: dict, prefix: str = "") -> dict:
    """`state_dict` (of `module`, its names after `prefix`) less `module`'s frozen parameters, by
    every name a tied one has, and less what is saved under such a name (a 4-bit weight's
    quantization state, `weight.absmax`): what a checkpoint keeps of the model. Edited in place."""
    frozen = frozen_names(module)
    for key in [k for k in state_dict if k.startswith(prefix)]:
        parts = key[len(prefix):].split(".")
        if any(".".join(parts[:i]) in frozen for i in range(1, len(parts) + 1)):
            del state_dict[key]
    return state_dict


def frozen_names(module: torch.nn.Module) -> set[str]:
    """The names of `module`'s frozen parameters, each name of a tied one."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


@contextmanager
def leaving_frozen_out(module: torch.nn.Module):
    """For the time of the block, `module.state_dict()` leaves out the frozen parameters and
    `module.load_state_dict(strict=True)` does not miss them: torch's state-dict hooks on the module
    whose state dict is saved and loaded (accelerate, DeepSpeed and torch.distributed.checkpoint all
    read and set it through these two methods)."""
    handles = [module.register_state_dict_post_hook(_drop_frozen),
               module.register_load_state_dict_post_hook(_frozen_not_missing)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _drop_frozen(module, state_dict, prefix, local_metadata) -> None:
    trained_only(module, state_dict, prefix)


def _frozen_not_missing(module, incompatible_keys) -> None:
    frozen = frozen_names(module)
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in frozen]


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def adam_step(states, param_groups) -> int:
    """AdamW's step count, from its per-parameter states or (DeepSpeed's CPU Adam) its groups."""
    for st in states:
        if "step" in st:
            return int(float(st["step"]))
    for g in param_groups:
        if "step" in g:
            return int(g["step"])
    return 0


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
