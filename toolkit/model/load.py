"""Model and tokenizer builders: a local Hugging Face folder, a Hub id or a built-in preset, then LoRA."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

from ..config import LoraConfig, ModelConfig, chat_template_text
from ..errors import ToolkitError, command
from . import heads
from .hub import resolve_model

PRESETS = Path(__file__).parent / "presets"

# Special tokens of the built-in byte-level tokenizer; the 256 byte symbols follow them.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (  # the presets' own; tools, tool calls and tool results rendered as JSON
    "{{ bos_token }}{% if tools %}{{ '<|tools|>\n' + (tools | tojson) + eos_token + '\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{{ '<tool_call>' + ((c['function'] if c['function'] is defined else c) | tojson) + '</tool_call>' }}"
    "{% endfor %}{% endif %}{{ eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.json"))


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built locally (no hub): every byte is a token, plus chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tokenizer(cfg: ModelConfig):
    """The model's tokenizer (the preset's byte tokenizer), with model.add_special_tokens added and
    model.chat_template in place of its own."""
    if cfg.preset is not None:
        tokenizer = build_byte_tokenizer()
    else:
        folder = resolve_model(cfg.path, cfg.revision)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                      trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            raise _load_error(cfg, folder, "a tokenizer", e) from None
        if tokenizer.pad_token is None:  # many base models ship without one; padding is masked anyway
            tokenizer.pad_token = tokenizer.eos_token
    new = [t for t in dict.fromkeys(cfg.add_special_tokens) if t not in tokenizer.get_vocab()]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    if cfg.chat_template is not None:
        set_chat_template(tokenizer, cfg.chat_template)
    if cfg.chat_template_kwargs:
        set_template_variables(tokenizer, cfg.chat_template_kwargs)
    return tokenizer


def disable_dropout(model: torch.nn.Module) -> int:
    """Every `nn.Dropout` layer's rate set to 0 (TRL's `disable_dropout_in_model`); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    for m in layers:
        m.p = 0.0
    return len(layers)


def set_template_variables(tokenizer, variables: dict) -> None:
    """model.chat_template_kwargs as `{%- set name = value %}` at the top of the tokenizer's template (each
    one, where a tokenizer has several): every rendering sees them, and the tokenizer saved with the run
    keeps them. A tokenizer without a template is one line."""
    import json

    if not tokenizer.chat_template:
        raise ToolkitError("model.chat_template_kwargs: the tokenizer has no chat template to give them to; "
                           "give one with model.chat_template")
    head = "".join(f"{{%- set {name} = {json.dumps(value)} %}}" for name, value in variables.items())
    template = tokenizer.chat_template
    tokenizer.chat_template = ({k: head + v for k, v in template.items()} if isinstance(template, dict)
                               else head + template)


def set_chat_template(tokenizer, value: str) -> None:
    """model.chat_template as the tokenizer's template (saved with it: final/ carries it), its Jinja
    compiled now so that a syntax error is one line naming the key, not a failure at the first row."""
    from jinja2 import TemplateSyntaxError

    try:
        tokenizer.chat_template = chat_template_text(value)
    except OSError as e:  # checked at load; gone since
        raise ToolkitError(f"model.chat_template: {value}: cannot read: {e.strerror}") from None
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                      tokenize=False)
    except TemplateSyntaxError as e:
        raise ToolkitError(f"model.chat_template: line {e.lineno}: not a Jinja template ({e.message})") from None
    except Exception:  # noqa: BLE001 - the template's own refusal of this conversation: rows will tell
        pass


def fit_vocabulary(model: torch.nn.Module, tokenizer, full_shape=lambda p: p.shape, mean: bool = True) -> int:
    """model.add_special_tokens: grow the input embeddings and the output layer (tied or not) to
    the tokenizer's length where the model has fewer rows, the new rows at the mean of the old ones
    (transformers' mean resizing; the same on every rank from the run's seed). Returns the rows
    added. `full_shape`: the backend's (a parameter partitioned at load is flat). `mean=False`: the
    new rows left as initialised, for a base whose adapter brings those rows (`token_rows`)."""
    rows = full_shape(model.get_input_embeddings().weight)[0]
    if len(tokenizer) <= rows:
        return 0
    model.resize_token_embeddings(len(tokenizer), mean_resizing=mean)
    return len(tokenizer) - rows


def token_rows(model: torch.nn.Module, tokenizer, tokens: list[str], added: int,
               full_shape=lambda p: p.shape) -> list[int]:
    """The embedding rows a LoRA run trains for model.add_special_tokens: the listed tokens' (new, or
    already in the tokenizer but perhaps never trained, like a base model's reserved chat tokens) and
    every row `fit_vocabulary` added, so no row of the saved adapter's vocabulary is left as random
    initialisation."""
    if not tokens:
        return []
    rows = full_shape(model.get_input_embeddings().weight)[0]
    return sorted(set(tokenizer.convert_tokens_to_ids(list(tokens))) | set(range(rows - added, rows)))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config_overrides(cfg: ModelConfig) -> dict:
    """What the recipe changes in the model's config: model.rope_scaling (as the keys it sets in
    `rope_parameters`) and model.max_position_embeddings. JSON-able, so an adapter can record it."""
    overrides = {}
    if cfg.rope_scaling is not None:
        overrides["rope_parameters"] = cfg.rope_scaling.parameters()
    if cfg.max_position_embeddings is not None:
        overrides["max_position_embeddings"] = cfg.max_position_embeddings
    return overrides


def apply_config_overrides(config, overrides: dict, where: str = "model.rope_scaling") -> None:
    """Set `overrides` (config_overrides) in a transformers config. The RoPE keys replace the scaling
    the model had, its rope_theta kept (passing rope_scaling to from_pretrained would lose it)."""
    if "rope_parameters" in overrides:
        text = config.get_text_config()
        current = getattr(text, "rope_parameters", None) or {}
        if any(isinstance(v, dict) for v in current.values()):
            raise ToolkitError(f"{where}: {type(config).__name__} keeps RoPE settings per attention type "
                               f"({', '.join(current)}); set them in its config.json instead")
        theta = current.get("rope_theta", getattr(text, "rope_theta", None))
        text.rope_parameters = {**({"rope_theta": theta} if theta is not None else {}), **overrides["rope_parameters"]}
        try:
            if hasattr(text, "validate_rope"):
                text.validate_rope()
        except (KeyError, ValueError) as e:
            raise ToolkitError(f"{where}: {e}") from None
    if "max_position_embeddings" in overrides:
        config.get_text_config().max_position_embeddings = overrides["max_position_embeddings"]


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                compute_dtype: torch.dtype = torch.bfloat16, scorer: bool = False) -> torch.nn.Module:
    """Load a local causal LM or build a preset. Weights stay in `dtype` (fp32 master weights by
    default; mixed precision is applied by autocast, not by casting the parameters); under
    model.load_in_4bit the linear layers are NF4 and compute in `compute_dtype`. `scorer` (a reward
    model, preference.method=reward): the same backbone with a sequence-classification head of one
    output instead of the output layer (`seed_score_head` draws a new head's weights)."""
    attn = cfg.attn_implementation
    if attn == "varlen":
        from . import varlen

        varlen.register()
        attn = varlen.NAME
    if cfg.preset is not None:
        preset = PRESETS / f"{cfg.preset}.json"
        if not preset.is_file():
            raise ToolkitError(f"model.preset: unknown preset '{cfg.preset}' (available: {', '.join(preset_names())})")
        config = LlamaConfig(**json.loads(preset.read_text()), attn_implementation=attn)
        apply_config_overrides(config, config_overrides(cfg))
        # The constructor, not from_config: from_config builds under ZeRO-3's zero.Init, whose
        # random initialisation differs from a plain one. Presets are tiny; every backend must
        # start from the same weights.
        if scorer:
            config.num_labels = 1
        # Outside ZeRO-3's view: a classifier builds its backbone by from_config, partitioned as it is built,
        # then initialises its weights on the empty shards (IndexError); prepare() partitions the whole model.
        with not_partitioned():
            model = (LlamaForSequenceClassification if scorer else LlamaForCausalLM)(config).to(dtype)
    else:
        folder = resolve_model(cfg.path, cfg.revision)
        check_head(folder, scorer)  # from its config.json, before transformers loads it as what it is not
        quantized = four_bit(compute_dtype) if cfg.load_in_4bit else {}
        attn = family_attention(cfg, folder, attn)
        try:
            if config_overrides(cfg):
                config = AutoConfig.from_pretrained(folder, local_files_only=True,
                                                    trust_remote_code=cfg.trust_remote_code)
                apply_config_overrides(config, config_overrides(cfg))
                quantized["config"] = config
            kind = AutoModelForSequenceClassification if scorer else AutoModelForCausalLM
            model = kind.from_pretrained(
                folder, local_files_only=True, dtype=dtype, attn_implementation=attn,
                trust_remote_code=cfg.trust_remote_code, **quantized, **({"num_labels": 1} if scorer else {}))
        except (OSError, ValueError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not heads.misfit(e):
                raise
            raise _load_error(cfg, folder, "a sequence-classification model" if scorer else "a causal LM", e) from None
        if cfg.load_in_4bit:
            one_4bit_path(model)
    if cfg.attn_implementation == "varlen":
        from .varlen import check_model

        check_model(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


@contextlib.contextmanager
def not_partitioned():
    """transformers' view of a ZeRO-3 run switched off while a model is built whole (never prepared, or
    partitioned by prepare() from whole weights)."""
    from transformers.integrations import deepspeed

    held = deepspeed._hf_deepspeed_config_weak_ref() if deepspeed._hf_deepspeed_config_weak_ref else None
    if held is not None:
        deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if held is not None:
            deepspeed.set_hf_deepspeed_config(held)


def check_head(folder: str, scorer: bool) -> None:
    """model.path's folder fits the objective, from its config.json and weights' headers, before it loads
    (`heads`): a reward model's (`scorer`) one label at most (`has_score_head`); a causal objective's no
    sequence-classification model (transformers would load it with a random output layer, and only warn)."""
    if not scorer and heads.is_scorer(heads.folder_config(folder)):
        raise ToolkitError(f"model.path: {folder} is a sequence-classification model (a reward model: a score, no "
                           "output layer); this recipe trains a causal LM: start from the causal LM it was made from "
                           "(preference.method=reward trains it further)")
    if scorer:
        has_score_head(folder)


def has_score_head(folder: str) -> bool:
    """Whether a model folder is a sequence-classification model with one output already (a reward
    model to train further), not a causal LM whose new head `seed_score_head` draws. One with
    another number of labels (transformers' default is 2, unwritten) is refused in one line, before
    the folder loads (as a one-label model its head would not fit)."""
    if not heads.is_scorer(heads.folder_config(folder)):
        return False
    if problem := heads.one_label_problem(folder):
        raise ToolkitError(f"model.path: {folder} is a sequence-classification model with {problem}; a reward "
                           "model has one score (num_labels 1): start from its causal LM or a one-label model")
    return True


def score_head(model: torch.nn.Module) -> torch.nn.Linear:
    """A sequence-classification model's head (`score` in most families, `classifier` in some)."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise ToolkitError(f"model: {type(model).__name__} has no linear score head (score or classifier) a reward "
                           "model can train")
    return head


def mark_scorer(model: torch.nn.Module, tokenizer) -> None:
    """A reward model's config as its folder must say it: its class (what AutoModel... builds) and the
    padding token its pooling finds each sequence's last token by (in the text config, where
    transformers reads it)."""
    model.config.architectures = [type(model).__name__]
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id


def seed_score_head(model: torch.nn.Module, seed: int, writable=contextlib.nullcontext) -> None:
    """A new score head's weights from the run's seed alone, N(0, initializer_range) as transformers
    draws them, so that every backend and process count starts alike (a head drawn inside ZeRO-3's
    zero.Init, or after other draws, would differ). `writable(params)`: the backend's context in
    which a partitioned parameter can be written (ZeRO-3 gathers it)."""
    head = score_head(model)
    std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
    with writable([head.weight] + ([head.bias] if head.bias is not None else [])):
        values = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * std
        head.weight.data.copy_(values.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.data.zero_()


def four_bit(compute_dtype: torch.dtype) -> dict:
    """from_pretrained arguments for a QLoRA base (NF4, double quantization, on this rank's GPU, or on
    the CPU of a host without one: bitsandbytes runs NF4 there from 0.50 on), or one line saying why
    this host cannot have one. The 4-bit weights are stored as `compute_dtype` elements
    (bnb_4bit_quant_storage), so FSDP shards them as it shards the rest."""
    from importlib import metadata

    try:
        version = metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        raise ToolkitError("model.load_in_4bit: QLoRA needs bitsandbytes: "
                           + command("python -m pip install bitsandbytes")) from None
    if not torch.cuda.is_available() and tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < (0, 50):
        raise ToolkitError(f"model.load_in_4bit: bitsandbytes {version} runs 4-bit layers on a CUDA GPU only and this "
                           "host has none; from 0.50 on it runs them on a CPU: "
                           + command("python -m pip install 'bitsandbytes>=0.50'"))
    from transformers import BitsAndBytesConfig
    from transformers.integrations import is_deepspeed_zero3_enabled

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=compute_dtype)
    if is_deepspeed_zero3_enabled():  # transformers refuses a device_map there; DeepSpeed places the model
        return {"quantization_config": config}
    return {"quantization_config": config,
            "device_map": {"": torch.cuda.current_device() if torch.cuda.is_available() else "cpu"}}


def one_4bit_path(model: torch.nn.Module) -> None:
    """Every 4-bit layer computes as in training (dequantize, then matmul in the compute dtype), in
    eval mode too. On a CPU with AVX512-BF16, bitsandbytes 0.50 otherwise repacks a layer's weight in
    place the first time it runs in eval mode without gradients, for a bf16 kernel: eval losses then
    depend on the host's CPU, the repacked weight is what later training steps read, and layers whose
    output width is not a multiple of 32 fail ("N must be divisible by block_n", the tiny presets' MLPs;
    tests/test_qlora.py)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def family_attention(cfg: ModelConfig, folder: str, attn: str) -> str:
    """sdpa, or eager for a family whose transformers class does not take sdpa (gpt-oss: its attention
    sinks), instead of transformers' refusal; build.setup_model says so."""
    if attn != "sdpa":
        return attn
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=cfg.trust_remote_code)
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (OSError, ValueError, KeyError):  # from_pretrained names what is wrong
        return attn
    return "eager" if getattr(cls, "_supports_sdpa", True) is False else attn


def _load_error(cfg: ModelConfig, folder: str, what: str, e: Exception) -> ToolkitError:
    where = cfg.path if folder == cfg.path else f"{cfg.path} ({folder})"
    if "trust_remote_code" in str(e) and not cfg.trust_remote_code:  # transformers' ValueError for custom code
        return ToolkitError(f"model.trust_remote_code: {where} needs its own Python code to load {what}; "
                            "set model.trust_remote_code=true if you trust its source")
    first_line = heads.MISFIT if heads.misfit(e) else (str(e).splitlines() or [type(e).__name__])[0]
    return ToolkitError(f"model.path: cannot load {what} from {where}: {first_line}")


def isolation_probe(model: torch.nn.Module, partitioned: bool = False) -> torch.nn.Module:
    """A model to run the packing and chunked-loss checks on: `model` itself, or, when its weights
    are `partitioned` before prepare() (ZeRO-3's zero.Init leaves every parameter an empty
    placeholder: the backend's `partitioned_before_prepare`), a randomly initialised copy of its
    architecture cut to one layer and a small vocabulary. Whether packed documents stay apart
    depends on how the architecture builds its attention mask, and what follows the output layer
    on the architecture too, not on weights."""
    if not partitioned:
        return model
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    config.vocab_size = 512
    config.pad_token_id = None
    with torch.random.fork_rng(devices=[]):  # its random init must not shift LoRA's, which comes next
        return type(model)(config).float()


def compile_layers(model: torch.nn.Module) -> int:
    """train.compile: torch.compile each decoder layer's forward in place, with dynamic shapes (a
    packed or padding-free batch has a new length every step). Parameter names, the state dict and
    the hooks backends put on modules stay as they are. Returns the number of layers compiled."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ToolkitError(f"train.compile: no decoder layers found in {type(base).__name__}; set train.compile=false")
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)


def apply_kernels(model: torch.nn.Module, cfg: ModelConfig) -> str | None:
    """model.kernels=liger: Liger-Kernel's RMSNorm, RoPE and MLP activation in place on the built model
    (not its cross-entropy: the loss stays train.loss's). Returns what was applied, for the start-of-run
    line (None without kernels). Call it after the checks that run the model on the CPU (the chunked
    loss, packing isolation): Triton runs on CUDA only, and Liger also patches the family's transformers
    module, so every model of that family built later in this process gets its kernels. A host without
    CUDA was refused with the launch (`launch_config.check`)."""
    if cfg.kernels == "none":
        return None
    from importlib import metadata

    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as e:  # the package without triton, or not for this transformers
        raise ToolkitError(f"model.kernels: liger-kernel cannot be imported here ({e}); "
                           + command("python -m pip install 'liger-kernel>=0.7'")) from None
    kind = model.config.model_type
    if kind not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ToolkitError(f"model.kernels: liger has no kernels for model type {kind} (it has "
                           f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set model.kernels=none")
    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)
    return f"liger-kernel {metadata.version('liger-kernel')} on {kind}: RMSNorm, RoPE and the MLP activation fused"


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Distinct leaf names of the linear layers a LoRA adapter can target."""
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sorted(names)


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, rows: list[int] = ()) -> torch.nn.Module:
    """A peft LoRA adapter on `model`; `rows` (`token_rows`): embedding rows trained whole besides, in
    the input embeddings and the output layer (peft's trainable tokens; a tied output layer shares them)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = cfg.target_modules
    if targets != "all-linear":
        targets = [targets] if isinstance(targets, str) else list(targets)
        available = linear_module_names(model)
        missing = [t for t in targets if t not in available]
        if missing:
            raise ToolkitError(
                f"lora.target_modules: {', '.join(missing)} not found in the model "
                f"(linear modules available: {', '.join(available)})")
    widths = [min(m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and (targets == "all-linear" or name.rsplit(".", 1)[-1] in targets)]
    if widths and cfg.r > max(widths):  # an update's rank is at most its layer's smaller side
        raise ToolkitError(f"lora.r: {cfg.r} is larger than every adapted layer can use (the widest allows "
                           f"{max(widths)}); choose a rank of at most {max(widths)}")
    tokens = trainable_token_layers(model, targets, rows) if rows else None
    peft_config = PeftLoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
        use_dora=cfg.use_dora, use_rslora=cfg.use_rslora, task_type="CAUSAL_LM", bias="none",
        trainable_token_indices=tokens)
    if getattr(model, "is_loaded_in_4bit", False):  # QLoRA: norms in fp32, input grads for checkpointing
        from peft import prepare_model_for_kbit_training

        # peft enables checkpointing again, without use_reentrant unless given (torch warns; the reentrant kind):
        # the same non-reentrant checkpointing as every other model here
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=model.is_gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    stacks = fused_expert_stacks(model) if targets == "all-linear" else []
    model = get_peft_model(model, peft_config)
    if stacks and not any(hasattr(m, "parameter_name") for m in model.modules()):
        # peft's all-linear reaches fused experts only for the families it converts (Mixtral, Qwen MoE); elsewhere
        # (gpt-oss) through target_parameters, named here: all-linear on a mixture-of-experts model means them too
        peft_config = dataclasses.replace(peft_config, target_parameters=stacks)
        model = get_peft_model(model.unload(), peft_config)
    for p in model.parameters():  # adapters train in fp32 even over a half-precision base
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return model


def fused_expert_stacks(model: torch.nn.Module) -> list[str]:
    """The leaf names of a mixture-of-experts model's fused expert weights (3-D parameters under `experts`)
    and of a router that is no linear layer, for peft's target_parameters."""
    names = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.ndim == 3 and ".experts." in f".{n}"}
    if names:
        names |= {f"{n.rsplit('.', 1)[-1]}.weight" for n, m in model.named_modules()
                  if n.rsplit(".", 1)[-1] in ("router", "gate") and not isinstance(m, torch.nn.Linear)
                  and getattr(m, "weight", None) is not None and m.weight.ndim == 2}
    return sorted(names)


def trainable_token_layers(model: torch.nn.Module, targets, rows: list[int]) -> dict[str, list[int]]:
    """peft's trainable_token_indices for `rows`: the input embeddings' and, when not tied to them,
    the output layer's (whose new rows would otherwise stay as initialised)."""
    names = {m: n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    layers = {names[embed]: list(rows)}
    if head is not None and head.weight is not embed.weight:
        if targets != "all-linear" and names[head] in targets:  # all-linear leaves the output layer out
            raise ToolkitError(f"lora.target_modules: {names[head]} is the output layer, whose rows of "
                               "model.add_special_tokens train whole; leave it out of the targets")
        layers[names[head]] = list(rows)
    return layers


def adapter_coverage(model: torch.nn.Module, full_shape=lambda p: p.shape) -> tuple[str, str | None]:
    """What a LoRA adapter reaches, as (a line, a warning or None): the share of the base model's
    parameters its layers adapt and, in a mixture-of-experts model, whether the experts (fused 3-D
    parameters since transformers 5, which a list of linear-layer names never reaches) and the
    router are among them. An adapter that leaves an MoE model's experts untouched is said at the
    start, not discovered after training. `full_shape`: the backend's (a partitioned parameter is flat)."""
    adapted, experts, routers = set(), {}, {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        if hasattr(module, "parameter_name"):  # peft's ParamWrapper: one parameter (a fused expert stack, a router)
            adapted.add(id(module.get_param()))
        elif hasattr(module, "get_base_layer"):
            adapted.add(id(module.get_base_layer().weight))
    total = 0
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if "lora_" in name or pname.startswith("lora_"):
                continue
            total += full_numel(p)
            if len(full_shape(p)) == 3:
                experts[id(p)] = full_numel(p)
            elif ("router" in type(module).__name__.lower()
                  or (experts and name.rsplit(".", 1)[-1] in ("gate", "router"))):
                routers[id(p)] = full_numel(p)
    share = sum(full_numel(p) for p in model.parameters() if id(p) in adapted) / max(total, 1)
    line = f"adapter on {100 * share:.1f}% of the base model's parameters"
    if not experts:
        return line, None
    reached = sum(v for k, v in experts.items() if k in adapted)
    line += (f"; experts: {'all' if reached == sum(experts.values()) else 'some' if reached else 'none'} "
             f"({100 * sum(experts.values()) / max(total, 1):.0f}% of the parameters), "
             f"router: {'yes' if any(k in adapted for k in routers) else 'no'}")
    warning = None
    if not reached:
        warning = ("lora.target_modules leaves the experts of this mixture-of-experts model untouched "
                   f"({100 * sum(experts.values()) / max(total, 1):.0f}% of its parameters, fused expert weights "
                   "that no linear-layer name reaches); lora.target_modules: all-linear adapts them")
    return line, warning


def full_numel(p: torch.nn.Parameter) -> int:
    """A parameter's size in the model: a ZeRO-3 partitioned parameter is empty here; ds_numel is its full size.
    A 4-bit weight (bitsandbytes' Params4bit) holds its values packed, several to an element: its
    quantization state has the layer's shape."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        return state.shape.numel()
    return getattr(p, "ds_numel", p.numel())


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(full_numel(p) for p in model.parameters())
    return trainable, total
