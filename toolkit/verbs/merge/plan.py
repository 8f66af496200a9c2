"""Reading and validating a merge: the adapter's config and tensors, its base (named, overridden or
moved), the base's shards and dtype, each adapted module and what it adds, all checked to fit before
anything is written."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ToolkitError
from ...model import base_identity

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# peft writes adapter keys under the PeftModel's prefix; what follows is the base model's own name.
ADAPTER_PREFIX = "base_model.model."
# Adapter tensor suffixes and what they are (everything else is a whole tensor that replaces the base's).
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "B_bias",
                 ".lora_embedding_A": "embedding_A", ".lora_embedding_B": "embedding_B",
                 ".lora_magnitude_vector": "magnitude"}
# The check fails above this max |logit difference|, relative to max(1, the largest |logit|): fp32
# differs only in summation order ((W + BA)x against Wx + B(Ax)); half precision rounds every merged weight.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "float64": 1e-4}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt",
                   "vocab.txt", "chat_template.jinja", "chat_template.json")


@dataclass
class Module:
    """One adapted layer of the base: its LoRA tensors and how they combine."""
    name: str
    tensors: dict[str, Any] = field(default_factory=dict)
    scale: float = 1.0
    fan_in_fan_out: bool = False

    @property
    def embedding(self) -> bool:
        return "embedding_A" in self.tensors


@dataclass
class Plan:
    adapter: Path
    base: Path
    config: dict  # the base's config.json
    shards: list[str]  # the base's safetensors files, in order
    index: dict | None  # the base's model.safetensors.index.json, when sharded
    modules: dict[str, Module]  # by the base weight's name (`<module>.weight`)
    bias_deltas: dict[str, Any]  # lora_bias: by the base bias's name, already scaled
    replaced: dict[str, Any]  # modules_to_save (and other whole tensors): by the base tensor's name
    description: str  # "LoRA r=8 alpha=16, DoRA"
    whole: bool = False  # adapters on parameters (target_parameters) or trained token rows: merged by peft in memory
    grows: bool = False  # trained token rows (model.add_special_tokens): the base grows to the adapter's tokenizer
    overrides: dict = field(default_factory=dict)  # the run's base config changes (RoPE scaling), applied to the base
    four_bit: bool = False  # trained over the base loaded in 4-bit (QLoRA), as the run's config.yaml says


def plan_merge(adapter: Path, base_override: str | None = None) -> Plan:
    """Read and check the adapter and its base before anything is written; each refusal is one line."""
    adapter_config = read_adapter_config(adapter)
    base = resolve_base(adapter, adapter_config, base_override)
    base_identity.check(adapter, base, "merge", "give the original base with --base, or train the adapter again")
    config = read_json(base / "config.json", f"merge: the base {base} has no config.json; "
                                             "expected a Hugging Face model folder")
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "quantized") if isinstance(quantization, dict) else "quantized"
        raise ToolkitError(f"merge: the base {base} is quantized ({method}); merge into a quantized base loses "
                           "quality; merge into the unquantized original of that model (--base PATH) instead")
    shards, index = base_shards(base)
    tokens = adapter_config.get("trainable_token_indices")  # a list, or lists by layer
    token_lists = [v for v in (tokens.values() if isinstance(tokens, dict) else [tokens]) if v] if tokens else []
    if token_lists:  # rows beyond the base's: grown to the adapter's tokenizer, which must be there
        top = max(max(v) for v in token_lists)
        if top >= vocab_size(config) and not has_tokenizer(adapter):
            raise ToolkitError(f"merge: {adapter} trains token rows up to {top}, beyond the {vocab_size(config)} rows "
                               f"of the base {base}, and has no tokenizer to grow the base to; put the run's "
                               "tokenizer files beside the adapter")
    whole = bool(adapter_config.get("target_parameters") or token_lists)
    if whole:  # checked by peft when it loads them (write_whole)
        modules, bias_deltas, replaced = {}, {}, {}
    else:
        modules, bias_deltas, replaced = parse_adapter(load_adapter_tensors(adapter), adapter_config, adapter)
        check_fits(modules, bias_deltas, replaced, base, shards, config)
    alpha = adapter_config.get("lora_alpha")
    parts = [f"LoRA r={adapter_config.get('r')} alpha={f'{alpha:g}' if isinstance(alpha, (int, float)) else alpha}"]
    parts += [name for key, name in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA")) if adapter_config.get(key)]
    if adapter_config.get("target_parameters"):
        description = ", ".join(parts) + f" on layers and parameters ({', '.join(adapter_config['target_parameters'])})"
    else:
        description = ", ".join(parts) + f" on {'layers' if whole else f'{len(modules)} layers'}"
    if token_lists:
        description += f", {max(map(len, token_lists))} embedding rows trained whole (model.add_special_tokens)"
    overrides = base_identity.config_overrides(adapter)
    if overrides:
        description += ", the run's " + " and ".join(f"{k} {v}" for k, v in overrides.items())
    four_bit = trained_over_4bit(adapter)
    if four_bit:
        description += ", trained over the base in 4-bit (QLoRA)"
    return Plan(adapter, base, config, shards, index, modules, bias_deltas, replaced, description, whole,
                bool(token_lists), overrides, four_bit)


def trained_over_4bit(adapter: Path) -> bool:
    """Whether `adapter` is the final/ of a run (config.yaml and manifest.json beside it) that
    trained it over its base loaded in 4-bit (model.load_in_4bit)."""
    import yaml

    run_dir = adapter.expanduser().resolve().parent
    if not (run_dir / "manifest.json").is_file():
        return False
    try:
        recipe = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    model = recipe.get("model") if isinstance(recipe, dict) else None
    return isinstance(model, dict) and model.get("load_in_4bit") is True


def loaded_base(plan: Plan, four_bit: bool = False):
    """The base as transformers loads it, with the run's config changes (RoPE scaling) when it made any;
    `four_bit`: its linear layers in NF4 as a QLoRA run loads them, computing in fp32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ...model import load

    extra = load.four_bit(torch.float32) if four_bit else {}
    if plan.overrides:
        extra["config"] = AutoConfig.from_pretrained(plan.base, local_files_only=True)
        load.apply_config_overrides(extra["config"], plan.overrides,
                                    where=f"merge: {plan.adapter}'s recorded rope_scaling")
    model = AutoModelForCausalLM.from_pretrained(plan.base, dtype=torch.float32, local_files_only=True, **extra)
    if four_bit:
        load.one_4bit_path(model)
    return model


def read_json(path: Path, missing: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ToolkitError(missing) from None
    except (OSError, ValueError) as e:
        raise ToolkitError(f"merge: cannot read {path}: {e}") from None


def read_adapter_config(adapter: Path) -> dict:
    if not adapter.is_dir():
        raise ToolkitError(f"merge: adapter folder not found: {adapter}")
    if not (adapter / "adapter_config.json").is_file():
        if (adapter / "final" / "adapter_config.json").is_file():
            raise ToolkitError(f"merge: {adapter} is a run folder; its adapter is {adapter / 'final'}")
        if (adapter / "config.json").is_file():
            raise ToolkitError(f"merge: {adapter} is already a full model (config.json, no adapter_config.json); "
                               "there is nothing to merge, use it as it is")
        raise ToolkitError(f"merge: {adapter} has no adapter_config.json; expected a peft LoRA adapter folder "
                           "(e.g. RUN/final of a LoRA run)")
    cfg = read_json(adapter / "adapter_config.json", "")
    if cfg.get("peft_type") != "LORA":
        raise ToolkitError(f"merge: {adapter} holds a {cfg.get('peft_type')} adapter; toolkit merge folds LoRA "
                           "adapters (plain, DoRA, rsLoRA) only")
    unsupported = [key for key in ("layer_replication", "megatron_config", "use_qalora") if cfg.get(key)]
    unsupported += variants_other_than_dora(cfg)
    if unsupported:
        raise ToolkitError(f"merge: {adapter}/adapter_config.json uses {', '.join(unsupported)}, which toolkit merge "
                           "does not fold; use peft's merge_and_unload() for it")
    return cfg


def variants_other_than_dora(cfg: dict) -> list[str]:
    """LoRA variants (peft marks their config fields) that change how an adapter merges; DoRA is handled here."""
    import dataclasses

    from peft import LoraConfig

    return [f.name for f in dataclasses.fields(LoraConfig)
            if f.metadata.get("is_lora_variant") and f.name != "use_dora" and cfg.get(f.name)]


def resolve_base(adapter: Path, cfg: dict, override: str | None) -> Path:
    """The base model's folder: --base, else the adapter's base_model_name_or_path (a folder, or a Hub id
    taken from the Hugging Face cache). A LoRA run on a preset records its own `base-model/` folder."""
    name = override or cfg.get("base_model_name_or_path")
    if not name:
        raise ToolkitError(f"merge: {adapter}/adapter_config.json names no base_model_name_or_path; "
                           "give the base with --base PATH")
    where = "--base" if override else "the adapter's base_model_name_or_path"
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from ...model.hub import is_hub_id, resolve_model

    if not is_hub_id(name):
        raise ToolkitError(f"merge: the base {name} ({where}) is not a folder; give the base with --base PATH")
    try:
        return Path(resolve_model(name, cfg.get("revision") if not override else None))
    except ToolkitError as e:
        raise ToolkitError(f"merge: the base {name} ({where}): {str(e).removeprefix('model.path: ')}") from None


def base_dtype(config: dict) -> str | None:
    """The base's dtype from its config (transformers writes `dtype`, older versions `torch_dtype`);
    None: keep each tensor's own dtype."""
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in TOLERANCE else None


def base_shards(base: Path) -> tuple[list[str], dict | None]:
    index_path = base / "model.safetensors.index.json"
    if index_path.is_file():
        index = read_json(index_path, "")
        shards = list(dict.fromkeys(index.get("weight_map", {}).values()))
        missing = [s for s in shards if not (base / s).is_file()]
        if missing:
            raise ToolkitError(f"merge: the base {base} misses {missing[0]} (named in model.safetensors.index.json)")
        return shards, index
    if (base / "model.safetensors").is_file():
        return ["model.safetensors"], None
    if any(base.glob("*.bin")) or any(base.glob("*.pt")):
        raise ToolkitError(f"merge: the base {base} has PyTorch .bin weights only; toolkit merge reads safetensors "
                           "(load it once and save_pretrained() it to convert)")
    raise ToolkitError(f"merge: the base {base} has no model.safetensors or model.safetensors.index.json")


def load_adapter_tensors(adapter: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    if (adapter / "adapter_model.safetensors").is_file():
        return load_file(adapter / "adapter_model.safetensors")
    if (adapter / "adapter_model.bin").is_file():
        return torch.load(adapter / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ToolkitError(f"merge: {adapter} has adapter_config.json but no adapter_model.safetensors")


def parse_adapter(tensors: dict, cfg: dict, adapter: Path) -> tuple[dict[str, Module], dict, dict]:
    """Group the adapter's tensors by the base layer they change, with each layer's scale as peft
    computes it: alpha / r, or alpha / sqrt(r) under rsLoRA, with per-layer rank_pattern / alpha_pattern."""
    from peft.utils.other import get_pattern_key

    by_name: dict[str, Module] = {}
    replaced = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(ADAPTER_PREFIX)
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            if ".lora_" in name or "trainable_tokens" in name:
                raise ToolkitError(f"merge: {adapter}: adapter tensor {key} is of a kind toolkit merge does not fold")
            replaced[name.replace(".base_layer.", ".")] = tensor  # modules_to_save; embeddings saved whole
            continue
        module = name[: -len(suffix)]
        by_name.setdefault(module, Module(module)).tensors[LORA_SUFFIXES[suffix]] = tensor
    modules, bias_deltas = {}, {}
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    for module in by_name.values():
        t = module.tensors
        a, b = (t.get("embedding_A"), t.get("embedding_B")) if module.embedding else (t.get("A"), t.get("B"))
        if a is None or b is None:
            raise ToolkitError(f"merge: {adapter}: layer {module.name} has only one of its two LoRA matrices")
        if a.ndim != 2 or b.ndim != 2:
            raise ToolkitError(f"merge: {adapter}: layer {module.name} is a convolution ({a.ndim}-D LoRA tensors); "
                               "toolkit merge folds linear and embedding layers")
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module.name), cfg.get("r"))
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module.name), cfg.get("lora_alpha"))
        if r != a.shape[0]:
            raise ToolkitError(f"merge: {adapter}: adapter_config.json gives layer {module.name} rank {r} but its "
                               f"lora_A has rank {a.shape[0]}")
        module.scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        module.fan_in_fan_out = bool(cfg.get("fan_in_fan_out")) and not module.embedding
        if cfg.get("use_dora"):
            if module.embedding:
                raise ToolkitError(f"merge: {adapter}: DoRA on the embedding {module.name} is not folded by "
                                   "toolkit merge; use peft's merge_and_unload() for it")
            if "magnitude" not in t:
                raise ToolkitError(f"merge: {adapter}: use_dora is set but layer {module.name} has no "
                                   "lora_magnitude_vector")
        if "B_bias" in t:
            bias_deltas[f"{module.name}.bias"] = t["B_bias"].float() * module.scale
        modules[f"{module.name}.weight"] = module
    return modules, bias_deltas, replaced


def check_fits(modules: dict, bias_deltas: dict, replaced: dict, base: Path, shards: list[str], config: dict) -> None:
    """Every tensor the adapter changes exists in the base, with the shape the adapter expects
    (headers only: safetensors reads shapes without loading the tensors)."""
    from safetensors import safe_open

    shapes = {}
    for shard in shards:
        with safe_open(base / shard, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    tied = " (the base ties lm_head to its input embeddings)" if config.get("tie_word_embeddings") else ""
    wanted = {name: delta_shape(m) for name, m in modules.items()}
    wanted.update({name: tuple(t.shape) for name, t in {**bias_deltas, **replaced}.items()})
    for name, shape in wanted.items():
        if name not in shapes:
            raise ToolkitError(f"merge: the adapter changes {name}, which the base {base} does not have{tied}; "
                               "was it trained on another model?")
        if shapes[name] != shape:
            raise ToolkitError(f"merge: the adapter's {name} has shape {list(shape)} but the base's is "
                               f"{list(shapes[name])}; was it trained on another model (or a resized vocabulary)?")


def delta_shape(m: Module) -> tuple[int, ...]:
    t = m.tensors
    if m.embedding:  # lora_embedding_A: r x num_embeddings, lora_embedding_B: embedding_dim x r
        return (t["embedding_A"].shape[1], t["embedding_B"].shape[0])
    out_features, in_features = t["B"].shape[0], t["A"].shape[1]
    return (in_features, out_features) if m.fan_in_fan_out else (out_features, in_features)


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES[:5])


def vocab_size(config: dict) -> int:
    """The embedding rows a config.json gives (its own vocab_size, or its text model's)."""
    text = config.get("text_config")
    return int(config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else 0) or 0)
