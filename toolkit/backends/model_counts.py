"""The model's counts for the memory model (`sizing.py`): its config.json read from a local folder, a
bare config.json, a Hub id (asked once, else the cache) or a preset, and the parameters, trainable and
frozen, counted on the meta device with LoRA as the recipe sets it. Nothing is loaded."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ToolkitError
from . import sequence
from .sizing import ModelCounts


def hub_config(repo_id: str, revision: str | None, key: str) -> str:
    """The config.json of a Hub model: asked of the Hub once (no retries: without a network the answer
    is at once), else from the Hugging Face cache; neither is one line naming both answers."""
    from huggingface_hub import HfApi, constants, hf_hub_download

    from ..model import hub  # noqa: F401 - every request with timeouts (hub.network_timeouts)

    hub_error = "HF_HUB_OFFLINE=1"
    if not constants.HF_HUB_OFFLINE:
        try:
            HfApi().model_info(repo_id, revision=revision)  # fails at once; hf_hub_download retries for 30 s
            return hf_hub_download(repo_id, "config.json", revision=revision)
        except Exception as e:  # noqa: BLE001 - no network, unknown or gated repo: the cache may hold it
            hub_error = f"Hub: {str(e).splitlines()[0][:160]}"
    try:
        return hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache
        raise ToolkitError(f"{key}: cannot read the config.json of {repo_id}: not in the Hugging Face cache "
                           f"({constants.HF_HUB_CACHE}) and {hub_error}") from None


def read_config(source: str, *, revision: str | None = None, key: str = "--model"):
    """A transformers config from a preset name, a model folder, a config.json or a cached Hub id."""
    from transformers import AutoConfig

    from ..model.load import PRESETS, preset_names

    path = Path(source).expanduser()
    if (PRESETS / f"{source}.json").is_file() and not path.exists():
        path = PRESETS / f"{source}.json"
    elif path.is_dir():
        path = path / "config.json"
    elif not path.exists():
        from ..model.hub import is_hub_id

        if not is_hub_id(source):
            raise ToolkitError(f"{key}: not found: {source} (a model folder, a config.json, a cached Hub id or a "
                               f"preset: {', '.join(preset_names())})")
        path = Path(hub_config(source, revision, key))
    try:
        data = json.loads(path.read_text())
        config = AutoConfig.for_model(**data)
    except FileNotFoundError:
        raise ToolkitError(f"{key}: {path.parent} has no config.json") from None
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own types (a strict dataclass's)
        cause = e.__cause__ or e  # the validator's own words, not its wrapper's
        raise ToolkitError(f"{key}: {path} is not a model config: {' '.join(str(cause).split())}") from None
    text = config.get_text_config()
    for size in SIZES:  # transformers accepts a negative or zero size; building the model (to count it) does not
        value = getattr(text, size, None)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ToolkitError(f"{key}: {path}: {size} is {value!r}; it must be a positive whole number")
    return config


# The sizes of a config that must be positive whole numbers for the model to exist.
SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "vocab_size", "head_dim", "max_position_embeddings")


def count_model(config, name: str, lora=None) -> ModelCounts:
    """Parameter counts from the model built on the meta device (no memory, no weights). `lora`:
    a config.LoraConfig; the adapters' parameters are counted by arithmetic, as peft adds them."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ToolkitError(f"{name}: no causal-LM class for model_type {config.model_type!r} in transformers") from None
    with torch.device("meta"):
        # The class itself, not from_config: inside a ZeRO-3 run from_config would build under zero.Init.
        model = cls(config)
    params = {id(p): p.numel() for p in model.parameters()}
    output = model.get_output_embeddings()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    matmul = sum(m.weight.numel() for _, m in linears)
    quantizable = [m.weight.numel() for _, m in linears if m is not output]  # what load_in_4bit makes NF4
    layer_type = next(iter(getattr(model, "_no_split_modules", None) or []), None)
    layer = max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ == layer_type),
                default=0)
    total, trainable = sum(params.values()), sum(params.values())
    adapted = []  # the linear layers LoRA adapts
    if lora is not None and lora.enabled:
        targets = None if lora.target_modules == "all-linear" else (
            {lora.target_modules} if isinstance(lora.target_modules, str) else set(lora.target_modules))
        adapted = [m for n, m in linears if m is not output and (targets is None or n.rsplit(".", 1)[-1] in targets)]
        trainable = sum(lora.r * (m.in_features + m.out_features) + (m.out_features if lora.use_dora else 0)
                        for m in adapted)
        total += trainable
    head = output.weight.numel() if trainable == total else 0
    text = config.get_text_config()
    heads, kv_heads = sequence.attention_heads(config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelCounts(name=name, params=total, trainable=trainable, matmul=matmul, layer=layer,
                       layers=text.num_hidden_layers, hidden=text.hidden_size, heads=heads, kv=kv_heads * head_dim,
                       intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
                       vocab=text.vocab_size, head=head, query=heads * head_dim, kv_heads=kv_heads,
                       quantized=sum(quantizable), quantized_layers=len(quantizable),
                       widest=max(quantizable, default=0),
                       lora_r=lora.r if adapted else 0, adapted=len(adapted),
                       adapted_inputs=sum(m.in_features for m in adapted))
