"""The optimizer a recipe names, built: `make` (optimizers.OPTIMIZERS says what each is), and `schedule`, the
learning-rate schedule of schedules.py. Kept apart from the tables so that loading a recipe imports no torch."""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import ToolkitError
from . import schedules


def make(name: str, groups: list[dict], t, device: torch.device, model: torch.nn.Module | None = None,
         args: dict | None = None) -> torch.optim.Optimizer:
    """The optimizer `name` over parameter `groups` (each with its weight_decay), with the recipe's
    train section `t` (lr, betas, eps) and `args` (train.optim_args) as extra keyword arguments."""
    return BUILDERS[name](groups, t, device, model, dict(args or {}))


def _adam_kwargs(t) -> dict:
    return {"lr": t.learning_rate, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_epsilon}


def _adamw(groups, t, device, model, args):
    # adamw_torch: fused on CUDA as before (one launch for all parameters); adamw_torch_fused: fused on any device
    # that has the kernel (CUDA and, since torch 2.4, the CPU)
    fused = True if device.type == "cuda" else None
    return torch.optim.AdamW(groups, **_adam_kwargs(t), fused=fused, **args)


def _adamw_fused(groups, t, device, model, args):
    return torch.optim.AdamW(groups, **_adam_kwargs(t), fused=True, **args)


def _sgd(groups, t, device, model, args):
    return torch.optim.SGD(groups, lr=t.learning_rate, **args)


def _adafactor(groups, t, device, model, args):
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=t.learning_rate, scale_parameter=False, relative_step=False, **args)


def _bitsandbytes(cls_name: str, bits: int, paged: bool) -> Callable:
    def build(groups, t, device, model, args):
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        manager.initialize()  # a process-wide registry keyed by id(): no override left from an earlier optimizer
        if bits == 8 and model is not None:  # as transformers' Trainer: embeddings keep 32-bit states
            for module in model.modules():
                if isinstance(module, torch.nn.Embedding) and module.weight.requires_grad:
                    manager.register_module_override(module, "weight", {"optim_bits": 32})
        kwargs = _adam_kwargs(t) if cls_name == "AdamW" else {"lr": t.learning_rate,
                                                                "betas": (t.adam_beta1, t.adam_beta2)}
        return getattr(bitsandbytes.optim, cls_name)(groups, **kwargs, optim_bits=bits, is_paged=paged, **args)

    return build


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon on the groups flagged `muon` (the hidden 2-D matrices), torch's AdamW on the rest
    (embeddings, the output layer, norms, biases), as Moonlight trains: one optimizer for accelerate
    and the checkpoints, each group stepped by its own algorithm's code over the shared state. Muon's
    update is scaled to AdamW's RMS (`adjust_lr_fn=match_rms_adamw`), so one learning rate serves both."""

    def __init__(self, groups: list[dict], lr: float, betas, eps: float, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, muon_eps: float = 1e-7,
                 ns_coefficients=(3.4445, -4.775, 2.0315), adjust_lr_fn: str = "match_rms_adamw"):
        adam = {"betas": betas, "eps": eps, "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                "differentiable": False, "fused": None, "decoupled_weight_decay": True}
        muon = {"momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "ns_coefficients": ns_coefficients,
                "adjust_lr_fn": adjust_lr_fn}
        for g in groups:
            if g.get("muon"):
                g.update(eps=muon_eps)
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "muon": False, **adam, **muon})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for cls, flagged in ((torch.optim.Muon, True), (torch.optim.AdamW, False)):
            groups = [g for g in self.param_groups if bool(g["muon"]) is flagged]
            if groups:  # the algorithm's own step over this optimizer's groups and state (the same objects)
                inner = cls.__new__(cls)
                inner.__dict__ = {**self.__dict__, "param_groups": groups}
                cls.step(inner)
        return loss


def _muon(groups, t, device, model, args):
    split, matrices = [], _hidden_matrices(model)
    for g in groups:  # Muon on the 2-D hidden matrices only; embeddings and the output layer stay on AdamW
        rest = {k: v for k, v in g.items() if k != "params"}
        hidden = [p for p in g["params"] if id(p) in matrices]
        other = [p for p in g["params"] if id(p) not in matrices]
        split += [{**rest, "params": hidden, "muon": True}] * bool(hidden) + [{**rest, "params": other}] * bool(other)
    return MuonAdamW(split, **_adam_kwargs(t), **args)


def _hidden_matrices(model) -> set[int]:
    """ids of the 2-D parameters that are neither an embedding nor the output layer."""
    if model is None:
        raise ToolkitError("train.optim: muon needs the model to tell its hidden matrices apart")
    edges = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            edges |= {id(p) for p in module.parameters()}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            edges |= {id(p) for p in module.parameters()}
    return {id(p) for p in model.parameters() if p.ndim == 2 and id(p) not in edges}


BUILDERS: dict[str, Callable] = {
    "adamw_torch": _adamw, "adamw_torch_fused": _adamw_fused, "sgd": _sgd, "adafactor": _adafactor, "muon": _muon,
    "adamw_8bit": _bitsandbytes("AdamW", 8, False), "paged_adamw_8bit": _bitsandbytes("AdamW", 8, True),
    "paged_adamw_32bit": _bitsandbytes("AdamW", 32, True), "lion_8bit": _bitsandbytes("Lion", 8, False),
    "lion_32bit": _bitsandbytes("Lion", 32, False),
}


def schedule(optimizer, t, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedule of train section `t` over a run of `total_steps` optimizer steps."""
    warmup = schedules.warmup_steps(t, total_steps)
    if t.lr_scheduler_type == schedules.DEFAULT:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedules.warmup_cosine(warmup, total_steps,
                                                                                   t.min_lr_ratio))
    from transformers import get_scheduler

    kwargs = dict(t.lr_scheduler_kwargs)
    if t.lr_scheduler_type == "cosine_with_min_lr" and not {"min_lr", "min_lr_rate"} & set(kwargs):
        kwargs["min_lr_rate"] = t.min_lr_ratio  # the recipe's floor where the kwargs give none
    return get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=kwargs)
