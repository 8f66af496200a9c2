"""Validation of the model and lora sections: attention and kernels installed, one of path or preset,
RoPE scaling's keys and values, the chat template, LoRA's values, base dtype and QLoRA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import command
from .model import CHAT_TEMPLATES, ROPE_KEYS, ModelConfig
from .recipe import Recipe

JINJA_WORDS = {"true", "false", "none", "True", "False", "None", "and", "or", "not", "in", "is", "if", "else", "for",
               "set", "loop", "self", "super", "block", "macro", "endfor", "endif"}


def validate_model(r: Recipe, need) -> None:
    """The model and lora sections, in the order their keys are checked."""
    if r.model.attn_implementation == "flash_attention_2":
        need(importlib.util.find_spec("flash_attn") is not None, "model.attn_implementation",
             f"flash_attention_2 needs the flash-attn package ({command('python -m pip install flash-attn')}, CUDA "
             "only); "
             "varlen gives the same kernel through PyTorch")
    need((r.model.path is None) != (r.model.preset is None), "model",
         "set exactly one of model.path (a local Hugging Face folder) or model.preset")
    need(all(isinstance(t, str) and t.strip() for t in r.model.add_special_tokens), "model.add_special_tokens",
         f"each token must be non-empty text, got {r.model.add_special_tokens!r}")
    if r.model.chat_template is not None:
        validate_chat_template(r.model, need)
    for key in r.model.chat_template_kwargs:
        need(key.isidentifier() and key not in JINJA_WORDS, f"model.chat_template_kwargs.{key}",
             "not a name a template can read (letters, digits and _, not a Jinja keyword)")
    if r.model.rope_scaling is not None:
        rope = r.model.rope_scaling
        needed, allowed = ROPE_KEYS[rope.rope_type]
        given = set(rope.parameters()) - {"rope_type"}
        missing, extra = needed - given, given - needed - allowed
        # the values of what is given first; transformers only warns about them and builds the model with them
        need(rope.factor is None or rope.factor > 0, "model.rope_scaling.factor",
             f"must be positive, got {rope.factor}")
        need(rope.factor is None or rope.factor >= 1, "model.rope_scaling.factor",
             f"must be at least 1 (how many times longer the context becomes), got {rope.factor}")
        for key in ("original_max_position_embeddings", "attention_factor"):
            value = getattr(rope, key)
            need(value is None or value > 0, f"model.rope_scaling.{key}", f"must be positive, got {value}")
        fast = rope.beta_fast if rope.beta_fast is not None else 32.0
        slow = rope.beta_slow if rope.beta_slow is not None else 1.0
        need(fast > slow, "model.rope_scaling.beta_fast",
             f"must be above beta_slow (defaults 32 and 1), got beta_fast={fast:g}, beta_slow={slow:g}")
        low, high = rope.low_freq_factor, rope.high_freq_factor
        need(low is None or high is None or low < high, "model.rope_scaling.low_freq_factor",
             f"must be below high_freq_factor, got {low} and {high}")
        need(not missing, f"model.rope_scaling.{min(missing) if missing else ''}",
             f"required for rope_type {rope.rope_type}")
        need(not extra, f"model.rope_scaling.{min(extra) if extra else ''}", f"not a {rope.rope_type} setting")
    need(r.model.max_position_embeddings is None or r.model.max_position_embeddings > 0,
         "model.max_position_embeddings", f"must be positive, got {r.model.max_position_embeddings}")
    need(r.model.max_position_embeddings is None or r.model.max_position_embeddings >= r.data.max_seq_len,
         "model.max_position_embeddings",
         f"{r.model.max_position_embeddings} is shorter than data.max_seq_len={r.data.max_seq_len}")
    need(not r.model.activation_offload or r.model.gradient_checkpointing, "model.activation_offload",
         "offloads the activations that gradient checkpointing keeps; set model.gradient_checkpointing=true too")
    if r.model.kernels == "liger":
        need(importlib.util.find_spec("liger_kernel") is not None, "model.kernels",
             "liger needs the liger-kernel package (Triton kernels, run on a CUDA GPU), which is not installed: "
             + command("python -m pip install 'liger-kernel>=0.7'"))
        need(not r.model.tiled_mlp, "model.kernels",
             "liger replaces each MLP's forward with its fused SwiGLU, which model.tiled_mlp would leave untiled; "
             "choose one of them")
    need(r.model.router_aux_loss_coef is None or r.model.router_aux_loss_coef >= 0, "model.router_aux_loss_coef",
         f"must be 0 or more, got {r.model.router_aux_loss_coef}")
    need(r.lora.r > 0, "lora.r", f"must be positive, got {r.lora.r}")
    need(r.lora.alpha > 0, "lora.alpha", f"must be positive, got {r.lora.alpha}")
    need(0.0 <= r.lora.dropout < 1.0, "lora.dropout", f"must be in [0, 1), got {r.lora.dropout}")
    need(bool(r.lora.target_modules), "lora.target_modules", "must name at least one module")
    need(r.lora.loraplus_lr_ratio is None or r.lora.loraplus_lr_ratio > 0, "lora.loraplus_lr_ratio",
         f"must be positive (LoRA+ suggests 16), got {r.lora.loraplus_lr_ratio}")
    need(r.lora.loraplus_lr_ratio is None or r.lora.enabled, "lora.loraplus_lr_ratio",
         "LoRA+ sets the adapters' learning rates: it needs lora.enabled=true")
    need(r.lora.loraplus_lr_embedding > 0, "lora.loraplus_lr_embedding",
         f"must be positive, got {r.lora.loraplus_lr_embedding}")
    if r.model.dtype != "fp32":
        need(r.lora.enabled, "model.dtype",
             f"{r.model.dtype} weights are for a frozen LoRA base; full fine-tuning keeps fp32 master weights "
             "(set train.precision for mixed precision)")
        need(r.train.precision == r.model.dtype, "model.dtype",
             f"{r.model.dtype} base weights need train.precision={r.model.dtype}, got {r.train.precision}")
    if r.model.load_in_4bit:
        need(r.lora.enabled, "model.load_in_4bit",
             "a 4-bit base cannot be trained itself: QLoRA needs lora.enabled=true")
        need(r.model.path is not None, "model.load_in_4bit",
             "QLoRA quantizes a model.path base while loading it; a preset is built in full precision")
        need(importlib.util.find_spec("bitsandbytes") is not None, "model.load_in_4bit",
             f"QLoRA's 4-bit layers come from bitsandbytes, which is not installed: "
             f"{command('python -m pip install bitsandbytes')}")


def validate_chat_template(m: ModelConfig, need) -> None:
    """model.chat_template names a built-in, holds the template, or names a readable UTF-8 file (kept
    as its path, `~` expanded)."""
    value = m.chat_template
    need(value.strip() != "", "model.chat_template",
         f"empty: give a Jinja file, the template itself or {', '.join(CHAT_TEMPLATES)}")
    if value in CHAT_TEMPLATES or "{{" in value or "{%" in value:
        return
    path = Path(value).expanduser()
    need(path.is_file(), "model.chat_template",
         f"{'is a folder' if path.is_dir() else 'file not found'}: {value} (give a Jinja file, the template itself, "
         f"or {', '.join(CHAT_TEMPLATES)})")
    try:
        problem = None if path.read_text(encoding="utf-8").strip() else "the file is empty"
    except UnicodeDecodeError as e:
        problem = f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    except OSError as e:
        problem = f"cannot read: {e.strerror}"
    need(problem is None, "model.chat_template", f"{value}: {problem}")
    m.chat_template = str(path)
