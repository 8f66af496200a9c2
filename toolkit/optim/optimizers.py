"""The optimizers a recipe names (`train.optim`), by transformers' `optim` names and with the keyword
arguments transformers' Trainer gives each (`transformers/trainer_optimizer.py`), so a TRL or Trainer
config in hand means the same optimizer here.

Each `Optimizer` entry says what the rest of the toolkit must know of it: the per-parameter state
it keeps (`elementwise`: tensors of the parameter's own shape, which a backend that flattens or shards
parameters can still hold and gather by name), whether it needs each parameter whole (`whole`:
Adafactor's factored moments, Muon's orthogonalised matrices, bitsandbytes' block-wise 8-bit
states and C kernels see the tensor they are given, so a shard or ZeRO's flat partition changes what
is learned), and the bytes of state per parameter for `toolkit estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ToolkitError


@dataclass(frozen=True)
class Optimizer:
    name: str
    what: str
    """One line for the start-of-run summary."""
    elementwise: tuple[str, ...] | None
    """Its per-parameter state tensors, each of the parameter's shape (None: not all of them are)."""
    state_bytes: float
    """Bytes of state per trained parameter, at most (Adafactor's factored moments are less)."""
    package: str | None = None
    """The pip package it needs beyond the toolkit's own."""
    why_whole: str = ""
    """Why it needs each parameter whole (where `elementwise` is None)."""

    @property
    def whole(self) -> bool:
        """It needs each parameter whole: under FSDP's shards or ZeRO's flat partitions it would learn otherwise."""
        return self.elementwise is None


OPTIMIZERS = {o.name: o for o in (
    Optimizer("adamw_torch", "torch AdamW", ("exp_avg", "exp_avg_sq"), 8),
    Optimizer("adamw_torch_fused", "torch AdamW, fused kernel", ("exp_avg", "exp_avg_sq"), 8),
    Optimizer("sgd", "torch SGD", ("momentum_buffer",), 4),
    Optimizer("adafactor", "transformers Adafactor (factored second moment, scale_parameter and relative_step off)",
              None, 4, why_whole="its second moment is factored by each matrix's rows and columns"),
    Optimizer("muon", "torch Muon on hidden 2-D matrices, AdamW on embeddings, head, norms and biases", None, 4,
              why_whole="it orthogonalises each whole matrix's update"),
    *(Optimizer(name, f"bitsandbytes {what}", None, size, "bitsandbytes",
                why_whole="its states and kernels are bitsandbytes' own, per whole tensor (8-bit: in blocks)")
      for name, what, size in (("adamw_8bit", "AdamW, 8-bit states", 2),
                               ("paged_adamw_8bit", "AdamW, 8-bit paged states", 2),
                               ("paged_adamw_32bit", "AdamW, 32-bit paged states", 8),
                               ("lion_8bit", "Lion, 8-bit states", 1),
                               ("lion_32bit", "Lion, 32-bit states", 4))),
)}


def sharding_problem(name: str, sharded_by: str) -> str | None:
    """Why optimizer `name` cannot train under `sharded_by` (FSDP's shards, ZeRO's flat partitions), or None."""
    o = OPTIMIZERS[name]
    if not o.whole:
        return None
    fits = ", ".join(n for n, x in OPTIMIZERS.items() if not x.whole)
    return (f"{name} needs each parameter whole ({o.why_whole}) and {sharded_by}, so it would learn otherwise than on "
            f"one process; use {fits} there, or DDP (whole parameters on every process)")
NAMES = tuple(OPTIMIZERS)


def make(name: str, groups: list[dict], t, device: torch.device, model: torch.nn.Module | None = None,
         args: dict | None = None) -> torch.optim.Optimizer:
    """The optimizer `name` over parameter `groups` (each with its weight_decay), with the recipe's
    train section `t` (lr, betas, eps) and `args` (train.optim_args) as extra keyword arguments."""
    return BUILDERS[name](groups, t, device, model, dict(args or {}))


def learning_rates(model: torch.nn.Module, lora, t) -> dict[str, float]:
    """The parameters, by name, that train at another peak rate than train.learning_rate: LoRA+ (peft's
    `create_loraplus_optimizer`: the B matrices and the 1-D parameters at learning_rate x lora.loraplus_lr_ratio,
    adapters of an embedding at lora.loraplus_lr_embedding) and train.embedding_learning_rate (the trained
    weights of the input and output embeddings, new tokens' rows among them). Each follows the schedule."""
    lrs: dict[str, float] = {}
    modules = dict(model.named_modules())
    embeddings = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            embeddings |= {id(p) for p in module.parameters()}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = modules.get(".".join(name.split(".")[:-2]))
        if lora.enabled and lora.loraplus_lr_ratio is not None:
            if isinstance(owner, torch.nn.Embedding) or "lora_embedding_" in name:
                lrs[name] = lora.loraplus_lr_embedding
            elif "lora_B" in name or p.ndim == 1:
                lrs[name] = t.learning_rate * lora.loraplus_lr_ratio
        if t.embedding_learning_rate is not None and id(p) in embeddings and "lora_" not in name:
            lrs[name] = t.embedding_learning_rate
    return lrs


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

# what `make` fills from the recipe: never a key of train.optim_args
_FILLED = {"self", "params", "lr", "betas", "eps", "optim_bits", "is_paged", "scale_parameter", "relative_step",
           "fused"}


def args_accepted(name: str) -> list[str]:
    """The keyword arguments optimizer `name` takes in train.optim_args."""
    import inspect

    if name.startswith(("adamw_8", "paged_", "lion_")):
        import bitsandbytes

        cls = getattr(bitsandbytes.optim, "Lion" if name.startswith("lion") else "AdamW")
    else:
        from transformers.optimization import Adafactor

        cls = {"adamw_torch": torch.optim.AdamW, "adamw_torch_fused": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "adafactor": Adafactor, "muon": MuonAdamW}[name]
    return [p for p in inspect.signature(cls.__init__).parameters if p not in _FILLED and p != "groups"
            and p != "weight_decay"]
