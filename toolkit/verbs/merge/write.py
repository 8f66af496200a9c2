"""Writing a merge: each base tensor read once, the adapter's delta folded in (`merge_weight`), each
shard written when complete; or, for adapters on parameters and grown vocabularies, the whole model
merged by peft in memory; then the tokenizer and the configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...errors import ToolkitError
from ...training.card import merged_card
from .plan import TOKENIZER_FILES, Module, Plan, base_dtype, has_tokenizer, loaded_base, read_json, vocab_size


def merge_weight(weight, m: Module):
    """peft's merge, in fp32: W + scale * (B @ A) (transposed for fan_in_fan_out; for an embedding
    (B @ A)^T); for DoRA then each output row rescaled to the learned magnitude,
    m / ||W + scale * B @ A|| (norm over the input dimension, peft's DoraLinearLayer.get_weight_norm)."""
    t = m.tensors
    w = weight.float()
    if m.embedding:
        return w + (t["embedding_B"].float() @ t["embedding_A"].float()).T * m.scale
    if m.fan_in_fan_out:  # stored (in, out), as GPT-2's Conv1D; work in nn.Linear's (out, in)
        w = w.T
    w = w + (t["B"].float() @ t["A"].float()) * m.scale
    if "magnitude" in t:
        import torch

        norm = torch.linalg.norm(w, dim=1)
        w = (t["magnitude"].float() / norm).view(-1, 1) * w
    return w.T if m.fan_in_fan_out else w


def write_weights(plan: Plan, tmp: Path, dtype: str | None) -> tuple[int, int, set[str]]:
    """Each base shard in turn, tensor by tensor, into a shard of the same name; returns the number of
    weights merged and replaced, and the floating-point dtypes written."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out_dtype = getattr(torch, dtype) if dtype else None
    merged = replaced = total_size = 0
    written = set()
    for shard in plan.shards:
        tensors = {}
        with safe_open(plan.base / shard, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                target = out_dtype if out_dtype is not None and tensor.is_floating_point() else tensor.dtype
                if key in plan.replaced:  # modules_to_save: the adapter's copy, in the base's dtype
                    tensor = plan.replaced[key]
                    replaced += 1
                if key in plan.modules:  # computed in fp32, rounded once
                    tensor = merge_weight(tensor, plan.modules[key])
                    merged += 1
                elif key in plan.bias_deltas:
                    tensor = tensor.float() + plan.bias_deltas[key]
                tensor = tensor.to(target).contiguous()
                tensors[key] = tensor
                if tensor.is_floating_point():
                    written.add(str(tensor.dtype).removeprefix("torch."))
                total_size += tensor.numel() * tensor.element_size()
        save_file(tensors, tmp / shard, metadata={"format": "pt"})
        del tensors  # before the next shard is read: about one shard in memory at a time
    if plan.index is not None:
        index = {**plan.index, "metadata": {**plan.index.get("metadata", {}), "total_size": total_size}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return merged, replaced, written


def write_whole(plan: Plan, tmp: Path, dtype: str | None, tokenizer) -> tuple[int, int, set[str]]:
    """An adapter on parameters as well as layers (peft's target_parameters: the fused expert stacks
    and routers of a mixture-of-experts model, which transformers 5 keeps fused in memory and saves
    per expert), or with trained token rows (model.add_special_tokens, over a base grown to the
    adapter's tokenizer first): base and adapter loaded in fp32, merged by peft's merge_and_unload,
    saved by transformers in the base's own checkpoint layout. Holds the whole model in memory,
    unlike the shard-by-shard path."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = grown(plan, loaded_base(plan), tokenizer)
            try:
                model = PeftModel.from_pretrained(model, plan.adapter)
            except (RuntimeError, ValueError, KeyError, IndexError) as e:  # shapes or names the base does not have
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise ToolkitError(f"merge: peft cannot load {plan.adapter} onto {plan.base}: {first}"
                                   + ("; the adapter's trained token rows need its own tokenizer beside it"
                                      if plan.grows else "")) from None
            merged = sum(1 for _, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
            model = model.merge_and_unload()
            out = getattr(torch, dtype or base_dtype(plan.config) or "float32")
            model.to(out).save_pretrained(tmp)
    finally:
        logging.set_verbosity(verbosity)
    return merged, 0, {str(out).removeprefix("torch.")}


def grown(plan: Plan, model, tokenizer):
    """With trained token rows (model.add_special_tokens), the base with as many embedding rows as the
    adapter's tokenizer has tokens, as the run trained it (the adapter's rows replace the new ones)."""
    from ...model.load import fit_vocabulary

    if plan.grows:
        fit_vocabulary(model, tokenizer, mean=False)
    return model


def write_tokenizer(plan: Plan, tmp: Path):
    """The adapter's tokenizer when it has one (a run saves it beside the adapter, chat template and
    all), else the base's; copied file by file, then loaded once to check it and to learn its eos."""
    from transformers import AutoTokenizer

    source = plan.adapter if has_tokenizer(plan.adapter) else plan.base
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    if (source / "additional_chat_templates").is_dir():
        shutil.copytree(source / "additional_chat_templates", tmp / "additional_chat_templates")
    try:
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ToolkitError(f"merge: no loadable tokenizer in {plan.adapter} or the base {plan.base}: {first}") from None


def with_overrides(config: dict, overrides: dict) -> dict:
    """A config.json (as a dict) with `model.config_overrides` applied: the RoPE keys replace the
    scaling (`rope_parameters`, or an older file's `rope_scaling`), its rope_theta kept."""
    config = dict(config)
    if "rope_parameters" in overrides:
        old = config.get("rope_parameters") or config.pop("rope_scaling", None) or {}
        theta = old.get("rope_theta", config.get("rope_theta")) if isinstance(old, dict) else config.get("rope_theta")
        config["rope_parameters"] = {**({"rope_theta": theta} if theta is not None else {}),
                                     **overrides["rope_parameters"]}
    if "max_position_embeddings" in overrides:
        config["max_position_embeddings"] = overrides["max_position_embeddings"]
    return config


def write_configs(plan: Plan, tmp: Path, dtype: str | None, tokenizer) -> None:
    """config.json with the written dtype, and generation_config.json whose eos includes the
    tokenizer's (the token the chat template ends a turn with), so an inference server stops there."""
    config = dict(plan.config)
    if plan.grows and len(tokenizer) > vocab_size(config):  # grown by write_whole to the adapter's tokenizer
        text = config.get("text_config") if "vocab_size" not in config else None
        if isinstance(text, dict):
            config["text_config"] = {**text, "vocab_size": len(tokenizer)}
        else:
            config["vocab_size"] = len(tokenizer)
    if dtype is not None:
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    if plan.overrides:  # the run's RoPE scaling and maximum positions, as the adapter's record says
        config = with_overrides(config, plan.overrides)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (plan.base / "generation_config.json").is_file():
        generation = read_json(plan.base / "generation_config.json", "")
    else:
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if config.get(k) is not None}
    eos = generation.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    card = plan.adapter / "README.md"
    text = merged_card(card.read_text(errors="replace")) if card.is_file() else None  # a run's card, of a plain model
    if text is not None:
        (tmp / "README.md").write_text(text)


