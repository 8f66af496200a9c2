"""The portable training state: what a run needs to continue under any backend and process count.

Every checkpoint holds, beside the backend's own sharded state (the fast path for a resume with
the same launch), `portable/`: the full fp32 weights of the trainable parameters
(`weights.safetensors`), their AdamW moments (`moments.safetensors`: `exp_avg/NAME`,
`exp_avg_sq/NAME`) and `state.json` (the AdamW step, the learning rate and hyperparameters of each
parameter group by parameter name, the scheduler's state, the loss scale). Names are the model's
own parameter names (peft's for an adapter), the same under every backend.

Gathered and set with the libraries' own full-state tools: torch.distributed.checkpoint's
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

from .backend import param_groups as build_groups
from .errors import ToolkitError
from .verify import first_mismatch, inject_corruption, tree_mismatch

FOLDER = "portable"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _engine(model):
    return model if hasattr(model, "zero_optimization_stage") else None  # a DeepSpeed engine


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather(accelerator, model, optimizer) -> tuple[dict, dict, dict]:
    """(weights, moments, state) of the trainable parameters, complete on the main process (a
    collective: every rank calls it)."""
    engine = _engine(model)
    if engine is not None:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        _link_zero12_states(engine.optimizer)
        weights, moments = {}, {}
        for name, p in _trainable(engine.module):  # same order on every rank: each tensor is a collective
            full = safe_get_full_fp32_param(p)
            states = [safe_get_full_optimizer_state(p, key) for key in MOMENTS]
            if not accelerator.is_main_process:
                continue  # every rank receives each whole tensor; only the main process keeps them
            weights[name] = full.detach().float().cpu()
            for key, m in zip(MOMENTS, states):
                moments[f"{key}/{name}"] = torch.zeros_like(weights[name]) if m is None else m.detach().float().cpu()
        base = engine.optimizer.optimizer  # the torch optimizer over ZeRO's fp32 partitions
        step = _adam_step(base.state.values(), base.param_groups)
        groups = _groups(engine.module, base.param_groups)
    else:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        names = dict(_trainable(accelerator.unwrap_model(model)))
        full = get_model_state_dict(model, options=_full_options())
        weights = {k: v.detach().float().cpu().contiguous() for k, v in full.items() if k in names}
        osd = get_optimizer_state_dict(model, optimizer, options=_full_options())
        moments = {}
        for name in names if accelerator.is_main_process else ():  # cpu_offload: the full state on rank 0 only
            st = osd.get("state", {}).get(name, {})
            for key in MOMENTS:
                m = st.get(key)
                moments[f"{key}/{name}"] = (torch.zeros_like(weights[name]) if m is None
                                            else m.detach().float().cpu().contiguous())
        step = _adam_step(osd.get("state", {}).values(), osd.get("param_groups", []))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "names": list(g["params"])}
                  for g in osd.get("param_groups", [])]
    return weights, moments, {"adam_step": step, "param_groups": _jsonable(groups)}


def save(accelerator, model, optimizer, scheduler, folder: Path, loss_scale: float | None) -> dict | None:
    """Write `folder/portable/` (main process; every rank takes part in the gather). Returns, on the
    main process, the tensors written, for `files_problem` to compare the files with."""
    from safetensors.torch import save_file

    weights, moments, state = gather(accelerator, model, optimizer)
    if not accelerator.is_main_process:
        return None
    target = Path(folder) / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(target / "weights.safetensors"))
    save_file(moments, str(target / "moments.safetensors"))
    state.update(scheduler={"class": type(_inner(scheduler)).__name__, "state": _jsonable(scheduler.state_dict())},
                 loss_scale=loss_scale)
    (target / "state.json").write_text(json.dumps(state, indent=1))
    if os.environ.get("TOOLKIT_FAULT_CORRUPT_PORTABLE") == "1":  # test seam: a bad write of portable/
        inject_corruption(target, force=True)
    return {**weights, **moments}


def files_problem(folder: Path, written: dict | None) -> str | None:
    """None when `folder/portable/` holds `written` (what `save` returned) bit for bit, else one
    line naming the first tensor that differs. Main process; None elsewhere."""
    return None if written is None else first_mismatch(Path(folder) / FOLDER, written)


def load(accelerator, model, optimizer, scheduler, folder: Path) -> None:
    """Set the prepared model, optimizer and scheduler from `folder/portable/`, whatever backend and
    process count wrote it. Every rank reads the files (each holds them whole for a moment)."""
    from safetensors.torch import load_file

    source = Path(folder) / FOLDER
    weights = load_file(str(source / "weights.safetensors"))
    moments = load_file(str(source / "moments.safetensors"))
    state = json.loads((source / "state.json").read_text())
    engine = _engine(model)
    module = engine.module if engine is not None else accelerator.unwrap_model(model)
    names = [n for n, _ in _trainable(module)]
    if sorted(names) != sorted(weights):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise ToolkitError(f"resume: {source} holds other trainable parameters than this model "
                           f"(missing {missing[:3]}, unexpected {extra[:3]})")
    saved_class, now_class = state["scheduler"]["class"], type(_inner(scheduler)).__name__
    if saved_class != now_class:
        raise ToolkitError(f"resume: {folder} was scheduled by {saved_class} and this launch by {now_class} (a "
                           "DeepSpeed JSON's scheduler block decides it); resume with the same scheduler")
    step = state["adam_step"]
    by_name = {n: g for g in state["param_groups"] for n in g["names"]}
    if engine is not None:
        _load_deepspeed(engine, weights, moments, step, by_name)
    else:
        _load_torch(model, optimizer, weights, moments, step, by_name)
    scheduler.load_state_dict(state["scheduler"]["state"])
    if state.get("loss_scale") is not None and getattr(accelerator, "scaler", None) is not None:
        accelerator.scaler.update(state["loss_scale"])


def read_back(accelerator, model, optimizer, scheduler, folder: Path) -> str | None:
    """After `load`: the state gathered again from this launch equals `folder/portable/` bit for
    bit (weights, moments, AdamW step, learning rates, scheduler), or the first difference in one
    line. A collective."""
    from safetensors.torch import load_file

    weights, moments, state = gather(accelerator, model, optimizer)
    if not accelerator.is_main_process:
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
        return f"AdamW step {state['adam_step']} where {saved['adam_step']} was saved"
    lrs = {n: g.get("lr") for g in state["param_groups"] for n in g["names"]}
    for group in saved["param_groups"]:
        for n in group["names"]:
            if lrs.get(n) != group.get("lr"):
                return f"learning rate of {n}: {lrs.get(n)} where {group.get('lr')} was saved"
    if _jsonable(scheduler.state_dict()) != saved["scheduler"]["state"]:
        return f"scheduler state {_jsonable(scheduler.state_dict())} where {saved['scheduler']['state']} was saved"
    return None


def _load_torch(model, optimizer, weights, moments, step, by_name) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    # Copies: the state-dict API renames keys of the dicts it is given in place (DDP's `module.`).
    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True, strict=False))
    current = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    for group in current["param_groups"]:
        saved = by_name[group["params"][0]]
        group.update({k: v for k, v in saved.items() if k not in ("names", "params")})
    current["state"] = {name: {"step": torch.tensor(float(step)), **{k: moments[f"{k}/{name}"] for k in MOMENTS}}
                        for name in weights} if step else {}
    set_optimizer_state_dict(model, optimizer, dict(current), options=StateDictOptions(full_state_dict=True))


def _load_deepspeed(engine, weights, moments, step, by_name) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero = engine.optimizer
    # Before its first step ZeRO holds no optimizer state: make it, zeros, for the load to fill.
    flats = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", ())
    for i, flat in enumerate(flats):
        state = zero.optimizer.state[flat]
        if "exp_avg" not in state:
            if getattr(zero, "_swappable_optimizer_subgroup", lambda i: False)(i):
                raise ToolkitError("resume: this launch offloads the optimizer state to NVMe, which a checkpoint "
                                   "of another layout cannot be loaded into; resume under CPU offload or none")
            adam = isinstance(zero.optimizer, (torch.optim.Adam, torch.optim.AdamW))  # torch's: a tensor step
            state.update(step=torch.tensor(float(step)) if adam else step,
                         **{key: torch.zeros_like(flat) for key in MOMENTS})
    _link_zero12_states(zero)
    for name, p in _trainable(engine.module):
        safe_set_full_fp32_param(p, weights[name])
        for key in MOMENTS:
            safe_set_full_optimizer_state(p, moments[f"{key}/{name}"], key)
    base = zero.optimizer
    for st in base.state.values():
        if "step" in st:
            st["step"] = torch.tensor(float(step)) if torch.is_tensor(st["step"]) else step
    for group in base.param_groups:
        if "step" in group:
            group["step"] = step
    # Hyperparameters by group: ZeRO keeps the torch optimizer's groups in the order it was given them.
    for group, ours in zip(base.param_groups, _groups(engine.module, base.param_groups)):
        saved = by_name[ours["names"][0]] if ours["names"] else None
        if saved:
            group.update({k: v for k, v in saved.items() if k in ("lr", "initial_lr", "betas", "eps", "weight_decay")})
    if hasattr(zero, "update_lp_params") and not hasattr(zero, "fp16_partitioned_groups_flat"):
        zero.update_lp_params()  # ZeRO-1/2: the working weights from the fp32 masters
    else:  # ZeRO-3: each sub-group's partition from its fp32 master, as DeepSpeed's own loader does
        for i, flat in enumerate(zero.fp16_partitioned_groups_flat):
            if flat is not None and zero.fp32_partitioned_groups_flat[i].numel():
                flat.data.copy_(zero.fp32_partitioned_groups_flat[i].data)
                zero._unflatten_partitioned_parameters(i)


def _link_zero12_states(zero) -> None:
    """ZeRO-1/2 links each parameter to its optimizer-state fragments once, right after the first
    group's first step, so the parameters of every later group are left without (DeepSpeed 0.19:
    `safe_get_full_optimizer_state` then fails with "exp_avg not found"). Link again, now that
    every group has its state."""
    if hasattr(zero, "_hp_optimizer_states_linked") and all(zero.optimizer.state[f] for f in
                                                            zero.single_partition_of_fp32_groups):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _trainable(module) -> list[tuple[str, torch.nn.Parameter]]:
    seen, out = set(), []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _groups(module, param_groups) -> list[dict]:
    """The optimizer's groups with parameter names in place of tensors (DeepSpeed's base optimizer
    holds flat partitions: its groups follow the order of the groups it was built from)."""

    built = build_groups(module, 0.0)
    if len(built) != len(param_groups):
        raise ToolkitError(f"checkpoint: the optimizer holds {len(param_groups)} parameter groups where the toolkit "
                           f"builds {len(built)}; its portable state cannot name them")
    names = {id(p): n for n, p in module.named_parameters()}
    return [{**{k: v for k, v in g.items() if k != "params"}, "names": [names[id(p)] for p in b["params"]]}
            for g, b in zip(param_groups, built)]


def _adam_step(states, param_groups) -> int:
    for st in states:
        if "step" in st:
            return int(float(st["step"]))
    for g in param_groups:
        if "step" in g:
            return int(g["step"])
    return 0


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
