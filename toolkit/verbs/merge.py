"""`toolkit merge ADAPTER_DIR --out DIR`: fold a LoRA adapter (plain, DoRA or rsLoRA) into its base and
write a plain Hugging Face folder that loads with `AutoModelForCausalLM.from_pretrained` alone.

The base's safetensors are read one tensor at a time and each output shard is written as soon as it
is complete, so memory holds about one shard (plus the adapter), never the whole model. Then a check
(on by default) runs a few prompts through the merged folder and through base + adapter under peft,
one model at a time, and compares the logits. Everything is written into DIR.tmp and renamed, so DIR
is either complete or absent; an existing non-empty DIR is refused.

A QLoRA adapter (trained over its base loaded in 4-bit, model.load_in_4bit) merges into the
full-precision base like any other: the check compares against the adapter on that same base, which
is what the merged weights are. The model the run trained differs from both by the base's NF4
quantization error; for the final/ of such a run the check also measures that difference, and says
it, without a tolerance (docs/models.md).

torch, transformers and peft are imported inside the functions: `toolkit --help` stays fast.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ToolkitError
from ..model import base_identity
from ..storage import disk

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The check fails above this max |logit difference|, relative to max(1, the largest |logit|): fp32
# differs only in summation order ((W + BA)x against Wx + B(Ax)); half precision rounds every merged weight.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "float64": 1e-4}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "merges.txt",
                   "vocab.txt", "chat_template.jinja", "chat_template.json")
CHECK_PROMPTS = ("The quick brown fox jumps over the lazy dog.", "def fibonacci(n):\n    ")
CHECK_CHAT = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
# peft writes adapter keys under the PeftModel's prefix; what follows is the base model's own name.
ADAPTER_PREFIX = "base_model.model."
# Adapter tensor suffixes and what they are (everything else is a whole tensor that replaces the base's).
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "B_bias",
                 ".lora_embedding_A": "embedding_A", ".lora_embedding_B": "embedding_B",
                 ".lora_magnitude_vector": "magnitude"}


def add_arguments(p) -> None:
    p.add_argument("adapter", metavar="ADAPTER_DIR", help="a peft LoRA adapter folder (e.g. RUN/final of a LoRA run)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write; must not exist or be empty")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="dtype of the merged weights (default: the base's, from its config.json)")
    p.add_argument("--base", default=None, metavar="PATH",
                   help="the base model folder or Hub id (default: the adapter's base_model_name_or_path)")
    p.add_argument("--skip-check", action="store_true",
                   help="skip comparing the merged model's logits with base + adapter (for models too big to load)")


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


def run(args) -> int:
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ToolkitError(f"merge: --out {out} exists and is not empty; choose another folder "
                           "(earlier results are never overwritten)")
    plan = plan_merge(Path(args.adapter), args.base)
    dtype = DTYPE_NAMES[args.dtype] if args.dtype else base_dtype(plan.config)
    print(f"merge: {plan.description} from {plan.adapter}, onto {plan.base}")
    with disk.renamed_into_place(out, "merge") as tmp:  # a failed check or a signal leaves no partial folder
        try:
            tmp.mkdir(parents=True)
            tokenizer = write_tokenizer(plan, tmp)
            merged, replaced, written = (write_whole(plan, tmp, dtype, tokenizer) if plan.whole else
                                         write_weights(plan, tmp, dtype))
            write_configs(plan, tmp, dtype, tokenizer)
        except OSError as e:
            raise ToolkitError(f"merge: cannot write {tmp}: {e.strerror or e}") from None
        shards = len(plan.shards)
        print(f"merge: {merged} weights merged, {replaced} replaced (modules_to_save), {shards} shard"
              f"{'s' if shards > 1 else ''} written ({', '.join(sorted(written))})")
        if not args.skip_check:
            # The loosest tolerance among the dtypes written (several only when the base mixes them).
            print(check(plan, tmp, tokenizer, max(written, key=tolerance_of, default="float32")))
    print(f"merged: {out}")
    return 0


# ----------------------------------------------------------------------------- reading and validating


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

    from ..model import load

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
    from ..model.hub import is_hub_id, resolve_model

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


# ----------------------------------------------------------------------------- merging and writing


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
    from ..model.load import fit_vocabulary

    if plan.grows:
        fit_vocabulary(model, tokenizer, mean=False)
    return model


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES[:5])


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
    if card.is_file() and card.read_text(errors="replace").startswith("---\nlibrary_name: peft\n"):  # a run's card
        text = card.read_text().replace("library_name: peft\n", "library_name: transformers\n", 1)
        (tmp / "README.md").write_text(text.replace("\n## Use\n", "\nMerged into its base by `toolkit merge`.\n\n"
                                                    "## Use\n", 1))


def vocab_size(config: dict) -> int:
    """The embedding rows a config.json gives (its own vocab_size, or its text model's)."""
    text = config.get("text_config")
    return int(config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else 0) or 0)


# ----------------------------------------------------------------------------- the check


def tolerance_of(dtype: str) -> float:
    return TOLERANCE.get(dtype, max(TOLERANCE.values()))


def check_inputs(tokenizer) -> list:
    texts = list(CHECK_PROMPTS)
    if tokenizer.chat_template:
        texts.append(tokenizer.apply_chat_template(CHECK_CHAT, tokenize=False, add_generation_prompt=True))
    return [tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids for text in texts]


def check(plan: Plan, merged_dir: Path, tokenizer, dtype: str) -> str:
    """Logits of the merged folder against base + adapter under peft, both in fp32, one model in memory
    at a time; a ToolkitError above the tolerance for the written dtype."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    inputs = check_inputs(tokenizer)
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # loading reports and progress bars would bury the one line that matters
    logging.disable_progress_bar()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = loaded_base(plan)
            reference = PeftModel.from_pretrained(grown(plan, base, tokenizer), plan.adapter).eval()
            expected = [reference(ids).logits for ids in inputs]
            del base, reference
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, local_files_only=True)
            got = [merged.eval()(ids).logits for ids in inputs]
            del merged
            trained = four_bit_logits(plan, tokenizer, inputs) if plan.four_bit else None
    except (OSError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ToolkitError(f"merge: check: cannot load the models to compare ({first}); "
                           f"{merged_dir} holds the merged files; --skip-check skips the check") from None
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    diff = max(float((a - b).abs().max()) for a, b in zip(expected, got))
    scale = max(1.0, max(float(a.abs().max()) for a in expected))
    tolerance = tolerance_of(dtype) * scale
    line = (f"check: merged vs base + adapter (peft), {len(inputs)} prompts in fp32: max |logit difference| "
            f"{diff:.2e} (tolerance {tolerance:.1e} for {dtype})")
    if not diff <= tolerance:  # NaN fails too
        raise ToolkitError(f"merge: {line}: too large; the merged files are left in {merged_dir} for inspection")
    if plan.four_bit:
        line += "\n" + (f"check: merged vs the adapter over the 4-bit (NF4) base it was trained on, in fp32: max "
                        f"|logit difference| {max(float((a - b).abs().max()) for a, b in zip(trained, got)):.2e}, "
                        "the base's quantization error (measured, not checked)" if trained is not None else
                        "check: trained over a 4-bit base; the merged model's difference from it (the base's "
                        "quantization error) is not measured here: no bitsandbytes that runs on this host")
    return line


def four_bit_logits(plan: Plan, tokenizer, inputs: list) -> list | None:
    """The logits of what a QLoRA run trained: the adapter over the base in 4-bit (None where this
    host cannot load it so: no bitsandbytes, or one too old for a host without CUDA)."""
    import importlib.util

    from peft import PeftModel

    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        base = loaded_base(plan, four_bit=True)
    except ToolkitError:
        return None
    model = PeftModel.from_pretrained(grown(plan, base, tokenizer), plan.adapter).eval()
    device = next(model.parameters()).device
    return [model(ids.to(device)).logits.float().cpu() for ids in inputs]
