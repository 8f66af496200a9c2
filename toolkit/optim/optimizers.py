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


# what `make` fills from the recipe: never a key of train.optim_args
_FILLED = {"self", "params", "lr", "betas", "eps", "optim_bits", "is_paged", "scale_parameter", "relative_step",
           "fused"}


def args_accepted(name: str) -> list[str]:
    """The keyword arguments optimizer `name` takes in train.optim_args (the recipe loads after the CLI's signal
    handler is in place, so torch is imported only now)."""
    import inspect

    import torch

    from .build import MuonAdamW

    if name.startswith(("adamw_8", "paged_", "lion_")):
        import bitsandbytes

        cls = getattr(bitsandbytes.optim, "Lion" if name.startswith("lion") else "AdamW")
    else:
        from transformers.optimization import Adafactor

        cls = {"adamw_torch": torch.optim.AdamW, "adamw_torch_fused": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "adafactor": Adafactor, "muon": MuonAdamW}[name]
    return [p for p in inspect.signature(cls.__init__).parameters if p not in _FILLED and p != "groups"
            and p != "weight_decay"]


def learning_rates(model, lora, t) -> dict[str, float]:
    """The parameters, by name, that train at another peak rate than train.learning_rate: LoRA+ (peft's
    `create_loraplus_optimizer`: the B matrices and the 1-D parameters at learning_rate x lora.loraplus_lr_ratio,
    adapters of an embedding at lora.loraplus_lr_embedding) and train.embedding_learning_rate (the trained
    weights of the input and output embeddings, new tokens' rows among them). Each follows the schedule."""
    import torch

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
