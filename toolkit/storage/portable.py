"""The portable training state: what a run needs to continue under any backend and process count.

Every checkpoint holds, beside the backend's own sharded state (the fast path for a resume with
the same launch), `portable/`: the full fp32 weights of the trainable parameters
(`weights.safetensors`), their optimizer's state tensors (`moments.safetensors`: `KEY/NAME`, e.g.
AdamW's `exp_avg/NAME` and `exp_avg_sq/NAME`, SGD's `momentum_buffer/NAME`, bitsandbytes' 8-bit
`state1/NAME` with `absmax1/NAME` and `qmap1/NAME`) and `state.json` (the optimizer's step, the rest of
each parameter's state by name (`scalars`), the learning rate and hyperparameters of each parameter
group by parameter name, the scheduler's state, the loss scale). Names are the model's
own parameter names (peft's for an adapter), the same under every backend.

Gathered and set by the run's backend (`portable_state`, `set_portable_state` in `backends/`) with
the libraries' own full-state tools: torch.distributed.checkpoint's
state-dict API for one process, DDP and FSDP; DeepSpeed's `safe_get/set_full_fp32_param` and
`safe_get/set_full_optimizer_state` for ZeRO (then its 16-bit working copies are refreshed from
the fp32 masters the way its universal-checkpoint loader does). Frozen weights are not in it: a
resumed run builds them again from the recipe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import ToolkitError
from .verify import first_mismatch, inject_corruption, tree_mismatch

FOLDER = "portable"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")  # what a portable state of before per-optimizer states holds


def gather(backend, model, optimizer) -> tuple[dict, dict, dict]:
    """(weights, moments, state) of the trainable parameters, complete on the main process (a
    collective: every rank calls it); the backend gathers the tensors its own way."""
    weights, moments, step, groups, scalars = backend.portable_state(model, optimizer)
    return weights, moments, {"adam_step": step, "param_groups": _jsonable(groups), "scalars": _jsonable(scalars)}


def save(backend, model, optimizer, scheduler, folder: Path) -> dict | None:
    """Write `folder/portable/` (main process; every rank takes part in the gather). Returns, on the
    main process, the tensors written, for `files_problem` to compare the files with."""
    from safetensors.torch import save_file

    weights, moments, state = gather(backend, model, optimizer)
    if not backend.accelerator.is_main_process:
        return None
    target = Path(folder) / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(target / "weights.safetensors"))
    save_file(moments, str(target / "moments.safetensors"))
    state.update(scheduler={"class": type(_inner(scheduler)).__name__, "state": _jsonable(scheduler.state_dict())},
                 loss_scale=backend.loss_scale(model))
    (target / "state.json").write_text(json.dumps(state, indent=1))
    if os.environ.get("TOOLKIT_FAULT_CORRUPT_PORTABLE") == "1":  # test seam: a bad write of portable/
        inject_corruption(target, force=True)
    return {**weights, **moments}


def files_problem(folder: Path, written: dict | None) -> str | None:
    """None when `folder/portable/` holds `written` (what `save` returned) bit for bit, else one
    line naming the first tensor that differs. Main process; None elsewhere."""
    return None if written is None else first_mismatch(Path(folder) / FOLDER, written)


def read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a portable safetensors file; one line naming it when it cannot be read (cut
    short by a full disk or a copy, damaged) instead of safetensors' traceback."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ToolkitError(f"{where}: {path} is missing; the checkpoint is incomplete") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError (and OSError)
        raise ToolkitError(f"{where}: {path} cannot be read ({' '.join(str(e).split())[:200]}); the file is cut "
                           "short or damaged: use an earlier checkpoint") from None


def load(backend, model, optimizer, scheduler, folder: Path) -> None:
    """Set the prepared model, optimizer and scheduler from `folder/portable/`, whatever backend and
    process count wrote it. Every rank reads the files (each holds them whole for a moment)."""
    source = Path(folder) / FOLDER
    weights = read_tensors(source / "weights.safetensors", "resume")
    moments = read_tensors(source / "moments.safetensors", "resume")
    state = json.loads((source / "state.json").read_text())
    names = [n for n, _ in backend.trainable(model)]
    if sorted(names) != sorted(weights):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise ToolkitError(f"resume: {source} holds other trainable parameters than this model "
                           f"(missing {missing[:3]}, unexpected {extra[:3]})")
    saved_class, now_class = state["scheduler"]["class"], type(_inner(scheduler)).__name__
    if saved_class != now_class:
        raise ToolkitError(f"resume: {folder} was scheduled by {saved_class} and this launch by {now_class} (a "
                           "DeepSpeed JSON's scheduler block decides it); resume with the same scheduler")
    by_name = {n: g for g in state["param_groups"] for n in g["names"]}
    backend.set_portable_state(model, optimizer, weights, moments, state["adam_step"], by_name, state.get("scalars"))
    scheduler.load_state_dict(state["scheduler"]["state"])
    scaler = backend.accelerator.scaler
    if state.get("loss_scale") is not None and scaler is not None:
        scaler.update(state["loss_scale"])


def read_back(backend, model, optimizer, scheduler, folder: Path) -> str | None:
    """After `load`: the state gathered again from this launch equals `folder/portable/` bit for
    bit (weights, moments, AdamW step, learning rates, scheduler), or the first difference in one
    line. A collective."""
    from safetensors.torch import load_file

    weights, moments, state = gather(backend, model, optimizer)
    if not backend.accelerator.is_main_process:
        return None
    source = Path(folder) / FOLDER
    saved = json.loads((source / "state.json").read_text())
    for name, want, have in (("weights", load_file(str(source / "weights.safetensors")), weights),
                             ("moments", load_file(str(source / "moments.safetensors")), moments)):
        if want.keys() != have.keys():
            return f"{name}: this launch has {len(have)} tensors where {len(want)} were saved"
        problem = tree_mismatch(want, have, name)
        if problem:
            return problem
    if state["adam_step"] != saved["adam_step"]:
        return f"optimizer step {state['adam_step']} where {saved['adam_step']} was saved"
    if "scalars" in saved and state["scalars"] != saved["scalars"]:
        return f"optimizer state {str(state['scalars'])[:200]} where {str(saved['scalars'])[:200]} was saved"
    lrs = {n: g.get("lr") for g in state["param_groups"] for n in g["names"]}
    for group in saved["param_groups"]:
        for n in group["names"]:
            if lrs.get(n) != group.get("lr"):
                return f"learning rate of {n}: {lrs.get(n)} where {group.get('lr')} was saved"
    if _jsonable(scheduler.state_dict()) != saved["scheduler"]["state"]:
        return f"scheduler state {_jsonable(scheduler.state_dict())} where {saved['scheduler']['state']} was saved"
    return None


def _inner(scheduler):
    return getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if torch.is_tensor(x):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return repr(x)


def host_state(value: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor's own host copy, fp32 where it is floating (8-bit states stay 8-bit)."""
    value = value.detach()
    return (value.float() if value.is_floating_point() else value).cpu().contiguous()


def state_by_name(weights: dict, moments: dict, step: int, scalars: dict | None) -> dict:
    """Each parameter's optimizer state, by name, from a portable state's files."""
    if scalars is None:  # written before per-optimizer states: AdamW's, its step shared
        return {name: {"step": torch.tensor(float(step)), **{k: moments[f"{k}/{name}"] for k in ADAM_MOMENTS}}
                for name in weights} if step else {}
    state: dict[str, dict] = {}

    def put(name: str, key: str, value) -> None:  # `a.b`: a nested state (bitsandbytes' quantization state)
        node = state.setdefault(name, {})
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value

    for full, tensor in moments.items():
        key, name = full.split("/", 1)
        put(name, key, tensor)
    for name, entries in scalars.items():
        for key, (is_tensor, value) in entries.items():
            put(name, key, torch.tensor(value) if is_tensor else value)
    return state


def flat_state(state: dict, prefix: str = "") -> dict:
    """A parameter's optimizer state with nested dicts flattened to dotted keys (bitsandbytes wraps its 8-bit
    states in `__bnb_optimizer_quant_state__`)."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, dict):
            flat.update(flat_state(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
