"""The model section's schema: `model` (ModelConfig, with `model.rope_scaling`) and `lora`, and the
chat templates `model.chat_template` may name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

ROPE_KEYS = {  # rope_type -> (keys it needs, keys it may have), as transformers' rope validation
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, {"original_max_position_embeddings"}),
    "yarn": ({"factor", "original_max_position_embeddings"}, {"attention_factor", "beta_fast", "beta_slow"}),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, set()),
}


CHAT_TEMPLATES = {  # model.chat_template's built-in names -> the template
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}


def chat_template_text(value: str) -> str:
    """model.chat_template's template: a built-in name's, the value itself where it holds Jinja
    tags (`{{`, `{%`), else the text of the file it names."""
    if value in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    return Path(value).expanduser().read_text(encoding="utf-8")


@dataclass
class RopeScaling:
    """RoPE scaling for a context longer than the model was trained on."""
    rope_type: Literal["linear", "dynamic", "yarn", "llama3"] = "yarn"
    """`linear` (position interpolation), `dynamic` (NTK, scaled as sequences grow), `yarn` or `llama3`."""
    factor: Optional[float] = None
    """How many times longer the context becomes (required)."""
    original_max_position_embeddings: Optional[int] = None
    """The context the model was trained on (yarn and llama3 need it; dynamic may take it)."""
    attention_factor: Optional[float] = None
    """yarn: the attention scale (default: from the factor)."""
    beta_fast: Optional[float] = None
    """yarn: fast boundary of the ramp (default 32)."""
    beta_slow: Optional[float] = None
    """yarn: slow boundary of the ramp (default 1)."""
    low_freq_factor: Optional[float] = None
    """llama3 (required there): the low-frequency factor."""
    high_freq_factor: Optional[float] = None
    """llama3 (required there): the high-frequency factor."""

    def parameters(self) -> dict:
        """The keys this scaling sets in the model config's rope parameters."""
        return {"rope_type": self.rope_type, **{k: v for k, v in dataclasses.asdict(self).items()
                                                 if k != "rope_type" and v is not None}}


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """A local Hugging Face causal-LM folder (config, weights, tokenizer), or a Hub id (`org/name`)
    downloaded into the Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`) at the first run and read from
    it after (only the cache under `HF_HUB_OFFLINE=1`)."""
    revision: Optional[str] = None
    """For a Hub id: the branch, tag or commit to use (default `main`)."""
    trust_remote_code: bool = False
    """Run the Python code a model ships with (models not built into transformers). Only for sources you trust."""
    preset: Optional[str] = None
    """A built-in model made from a config in toolkit/model/presets (e.g. `tiny-llama`)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "varlen"] = "sdpa"
    """`varlen` attends within each packed document from its bounds, with no mask: PyTorch's flash
    varlen kernel on CUDA in bf16/fp16, one SDPA call per document elsewhere (toolkit/model/varlen.py).
    `sdpa` and `eager` build a dense block-diagonal mask for packed rows."""
    gradient_checkpointing: bool = False
    """Activation checkpointing: each decoder layer's activations are recomputed in backward instead
    of kept (less memory, one more forward of each layer)."""
    tiled_mlp: bool = False
    """Long sequences: each decoder layer's MLP runs over tiles of hidden_size positions, each
    recomputed in backward, so its intermediate activations (the largest of a layer) exist for one
    tile at a time (the ALST recipe; toolkit/model/activations.py). Same result, one more MLP forward.
    Dense models only."""
    activation_offload: bool = False
    """Long sequences, with gradient_checkpointing: the activations kept for backward (each decoder
    layer's inputs) wait in pinned host memory instead of GPU memory, copied back when backward
    reaches their layer. Same result; costs host memory and copies (on a CPU host only the copies)."""
    kernels: Literal["none", "liger"] = "none"
    """`liger`: Liger-Kernel's fused Triton kernels for the model's RMSNorm, RoPE and MLP activation
    (SwiGLU; GEGLU in Gemma), on a CUDA GPU, for the model types Liger names (llama, mistral, mixtral,
    qwen2, qwen3, qwen3_moe, gemma, gemma2, gemma3_text, phi3 and more; another is refused when the model
    is built). The loss stays train.loss's (chunked never holds the full logits either), so Liger's fused
    linear cross-entropy is not used; the start-of-run line says so. Needs `pip install liger-kernel`
    (the `kernels` extra); refused in one line without it or without a CUDA GPU. Not with tiled_mlp."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Storage of the frozen base weights under LoRA: fp32 under any train.precision, or bf16/fp16 (half
    the memory) with the same train.precision. Trainable parameters and optimizer states are always fp32."""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base's linear layers in 4-bit NF4 (bitsandbytes, double quantization,
    computing in train.precision: fp32, bf16 or fp16) under a LoRA adapter. Trains on a CUDA GPU, and
    on a CPU host with bitsandbytes 0.50 or later, on one process, DDP, FSDP2 and DeepSpeed ZeRO-3.
    Needs `pip install bitsandbytes`, a model.path base and lora.enabled; refused in one line otherwise."""
    add_special_tokens: list[str] = field(default_factory=list)
    """Tokens to add to the tokenizer as special tokens (each one token, never split; a new
    end-of-turn or tool token, say). Where the model has no spare rows for them, its input
    embeddings and output layer (tied or not) grow to the tokenizer's length, the new rows started
    at the mean of the old ones, and they train with the rest; final/, checkpoints and `toolkit
    checkpoint convert` carry the grown model and the tokenizer. With lora.enabled the listed
    tokens' rows (and every added row) of the input embeddings and of an untied output layer train
    whole beside the adapter (peft's trainable tokens, saved in the adapter); `toolkit merge`,
    `generate` and `eval` grow the base to the adapter's tokenizer before loading it."""
    chat_template: Optional[str] = None
    """The chat template to render `messages` (and chat preference) rows with, in place of the
    tokenizer's own: a path to a Jinja file (relative to the working directory), the template itself
    (any value holding `{{` or `{%`), or `chatml` (each turn `<|im_start|>ROLE` ... `<|im_end|>`;
    add both markers to add_special_tokens to make each one token, so that `generate` stops at
    `<|im_end|>`). Read when the run starts (a changed file prepares the data again); the tokenizer
    saved in final/ holds it, so `generate`, `eval` and `merge` use it. Unset: the tokenizer's."""
    chat_template_kwargs: dict[str, Union[bool, int, float, str]] = field(default_factory=dict)
    """Variables for the chat template (TRL's `chat_template_kwargs`), e.g. `{enable_thinking: false}`
    for Qwen3 without its thinking block: set at the top of the template, so every rendering (the
    training rows, online RL's prompts, samples) sees them, the prepared data's cache key changes
    with them, and the tokenizer saved in final/ keeps them (`generate` and `eval` render as training
    did). Needs a chat template (the tokenizer's or model.chat_template)."""
    rope_scaling: Optional[RopeScaling] = None
    """Extend the context: RoPE scaling set in the model's config (its rope_theta kept) before it is
    built, so training, final/config.json, checkpoints and `toolkit checkpoint convert` carry it;
    a LoRA adapter records it beside itself (toolkit_base.json) and `toolkit merge`, `generate` and
    `eval` load its base with it. Not for models that keep RoPE settings per attention type (Gemma 3)."""
    max_position_embeddings: Optional[int] = None
    """The model's maximum positions, set in its config (with rope_scaling: usually the extended context)."""
    router_aux_loss_coef: Optional[float] = None
    """Mixture-of-experts models: the weight of the router's load-balancing loss added to the
    training loss (logged as `aux_loss`, the eval loss stays the language-model loss). Unset: as
    the model's config says (its `router_aux_loss_coef` when `output_router_logits` is true, else
    off); 0 turns it off. Refused on a model without a router."""


@dataclass
class LoraConfig:
    enabled: bool = False
    """False: full fine-tuning of every parameter."""
    r: int = 8
    """LoRA rank: the inner dimension of each adapter's two matrices."""
    alpha: float = 16.0
    """LoRA scale: the update is multiplied by alpha / r (alpha / sqrt(r) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: Union[str, list[str]] = "all-linear"
    """Module names to adapt, or `all-linear` for every linear layer but the output head."""
    use_dora: bool = False
    """DoRA: learn a magnitude per output feature beside the low-rank direction update (a little
    slower per step; `toolkit merge` folds it into the weights like plain LoRA)."""
    use_rslora: bool = False
    """rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r, so that large ranks still learn."""
    loraplus_lr_ratio: Optional[float] = None
    """LoRA+ (peft's create_loraplus_optimizer): the B matrices (and 1-D parameters) train at
    train.learning_rate x this (the paper suggests 16); the A matrices at train.learning_rate."""
    loraplus_lr_embedding: float = 1e-6
    """LoRA+: the learning rate of adapters on an embedding layer (peft's default 1e-6)."""
