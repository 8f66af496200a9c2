"""Recipes: one YAML file per run, loaded into a small tree of typed dataclasses.

Every field is typed; unknown keys, wrong types and contradictions raise `ConfigError`
naming the file and the dotted key. Command-line overrides use the same dotted keys
(`train.max_steps=20`) and are validated the same way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from .errors import ToolkitError, command


class ConfigError(ToolkitError):
    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")


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


@dataclass
class DataSource:
    """An entry of data.train_files / data.eval_files written as a mapping."""
    path: str = ""
    """A .json, .jsonl, .parquet or .csv file, a folder or glob of such shards, or a Hub dataset id."""
    format: Optional[Literal["alpaca", "messages", "text", "preference", "prompt"]] = None
    """This entry's format (default: data.format); every format renders through the same tokenizer.
    `preference` entries mix only with `preference` entries, `prompt` entries with `prompt` entries."""
    weight: Optional[float] = None
    """Share of the training set drawn from this entry, relative to the other entries' weights
    (the set keeps its total size: a heavier entry is repeated, a lighter one subsampled)."""
    max_rows: Optional[int] = None
    """Use only the first N rows of this entry."""
    split: str = "train"
    """Hub datasets and `save_to_disk` folders of a DatasetDict: the split to read."""
    revision: Optional[str] = None
    """Hub datasets: a branch, tag or commit."""
    columns: dict[str, str] = field(default_factory=dict)
    """Rename this entry's columns to the ones its format reads, `{from: to}`: `{question: prompt}` for
    a dataset whose prompts are in `question` (the other columns keep their names and still reach the
    reward functions). A column named here that the data lacks is refused in one line."""


@dataclass
class DataConfig:
    train_files: list[Union[str, DataSource]] = field(default_factory=list)
    """Local .json, .jsonl, .parquet or .csv files, folders or globs of them, Hub dataset ids,
    or mappings (see DataSource) with a weight or max_rows per entry."""
    eval_files: list[Union[str, DataSource]] = field(default_factory=list)
    """Held-out data, the same kinds of entries as train_files; its loss is the eval loss."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the training rows for eval when no eval_files are given."""
    format: Literal["alpaca", "messages", "text", "preference", "prompt"] = "alpaca"
    """`alpaca` (instruction, input, output), `messages` (chat turns through the tokenizer's chat
    template; ShareGPT `conversations` too), `text` (a `text` field, every token of it trained on, eos
    appended), or `preference` (`prompt`, `chosen`, `rejected`, each text or a list of chat messages,
    TRL's standard and conversational preference formats; a row without `prompt` whose chosen and
    rejected conversations share their opening turns has those turns as its prompt): each row is a
    pair of sequences, prompt + chosen and prompt + rejected, with targets on the completions only;
    text completions get the tokenizer's eos appended, chat ones end as the template ends a turn.
    A pair longer than max_seq_len keeps its prompt and has its completions cut (or is dropped
    with overlong=drop); for preference.method, which needs it; not with packing (padding_free
    puts a micro-batch's sequences in one row). Or `prompt` (online RL, rl.method): a `prompt` column,
    text or a list of chat messages (TRL's prompt-only formats), rendered up to where the answer
    starts; every other column of the row (an `answer`, say) goes to the reward functions. A prompt
    longer than max_seq_len is dropped (a cut prompt would lose where the answer starts)."""
    max_seq_len: int = 512
    """Longest example in tokens (see overlong); with packing, the length of a packed row."""
    packing: bool = False
    """Concatenate examples into rows of max_seq_len; documents never attend to each other."""
    padding_free: bool = False
    """Each micro-batch is one row: its examples (packed rows or documents) concatenated with no
    padding. Same examples, same loss; attention runs as model.attn_implementation=varlen unless
    flash_attention_2 or eager is chosen."""
    train_on_prompt: bool = False
    """By default the loss covers only response tokens."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """Examples longer than max_seq_len: cut to max_seq_len, or left out."""
    num_proc: Optional[int] = None
    """Processes that tokenize (default: the usable cores, at most 16; at least 1,000 rows each)."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Examples per device per forward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; the global batch is micro_batch_size x this x processes."""
    max_steps: Optional[int] = None
    """Optimizer steps; when unset, `epochs` passes over the data decide."""
    epochs: int = 1
    """Passes over the training data when max_steps is unset."""
    learning_rate: float = 2e-4
    """AdamW's peak learning rate, after linear warmup, before cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay, on matrices only (never norms or biases)."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to learning_rate; then cosine decay to the end."""
    min_lr_ratio: float = 0.0
    """Cosine decay ends at learning_rate * min_lr_ratio."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: `fp32`, `bf16` or `fp16` (fp16 only where a backend scales the loss: CUDA).
    Sets accelerate's autocast and DeepSpeed's bf16/fp16 sections alike."""
    initial_loss_scale: float = 65536.0
    """fp16 only: the dynamic loss scale's starting value, a power of two (accelerate's GradScaler
    init_scale; DeepSpeed's fp16.initial_scale_power is filled from it). A step whose gradients
    overflow is skipped and the scale halved."""
    compile: bool = False
    """torch.compile each decoder layer (dynamic shapes: packed and padding-free batches change
    length every step without recompiling). The first steps are slower while it compiles; the
    state dict and checkpoints are unchanged. Not with DeepSpeed ZeRO-3."""
    loss: Literal["chunked", "full"] = "chunked"
    """How the loss is computed (the same value either way). `chunked`: the output layer runs on
    loss_chunk_tokens target positions at a time and their logits are recomputed in backward, so
    the micro-batch's full-vocabulary logits are never held at once; `full`: all positions' logits
    at once, as the model's own forward gives them."""
    loss_chunk_tokens: int = 1024
    """train.loss=chunked: target positions per chunk (one chunk's logits are this x vocabulary floats)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    eval_every_steps: int = 0
    """0: evaluate only before training and at the end."""
    eval_batch_size: Optional[int] = None
    """Examples per device per eval forward (default: micro_batch_size; at most one rank's share)."""
    sample_prompts: list[str] = field(default_factory=list)
    """Prompts answered (greedily) at every evaluation, rendered as the data format renders a
    prompt; the answers are printed and kept in metrics.jsonl (`samples`)."""
    sample_max_new_tokens: int = 32
    """Longest answer to a sample prompt, in tokens."""
    log_every_steps: int = 10
    """Print a step line every N optimizer steps (metrics.jsonl gets every step)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = field(default_factory=list)
    """Trackers besides metrics.jsonl (always written), through accelerate, each getting every metrics row
    and the recipe as hyperparameters: `tensorboard` (event files in output_dir/tensorboard/; `pip install
    tensorboard`, which `make setup` installs), `wandb` (`pip install wandb`; a login, or WANDB_MODE=offline
    for a run folder under output_dir/wandb/), `mlflow` (`pip install mlflow-skinny`; MLFLOW_TRACKING_URI,
    else a file store in output_dir/mlruns/), `trackio` (`pip install trackio`; its local store, TRACKIO_DIR,
    or TRACKIO_SPACE_ID). A tracker that is not installed is refused when the recipe loads, one that does
    not start (no login, a server out of reach) before step 1, each in one line."""
    peak_tflops: Optional[float] = None
    """The device's dense peak TFLOP/s for MFU, when the GPU is not one the toolkit knows (H100, H200,
    A100, L40S, L4, B200); on a CPU host there is no MFU unless this is set."""
    profile_steps: Optional[list[int]] = None
    """[first, last]: write a torch profiler trace of these optimizer steps (output_dir/profile/)."""
    watchdog: bool = True
    """Every rank writes its Python stacks and the main process names the rank(s) not where the others
    are when a step, eval or save runs far longer than recent ones (20x their median, at least 120 s;
    600 s for the first of each kind)."""
    watchdog_seconds: Optional[float] = None
    """A fixed watchdog limit in seconds instead of the one derived from recent steps."""
    max_nonfinite_steps: int = 3
    """Stop after this many optimizer steps in a row with a non-finite loss or gradient (each one
    is skipped, never applied to the weights). Under fp16 a gradient overflow that leaves the loss
    scale at 1 or more is loss scaling at work and does not count."""


@dataclass
class PreferenceConfig:
    method: Optional[Literal["dpo", "orpo", "simpo"]] = None
    """None: supervised fine-tuning. `dpo` (Direct Preference Optimization, against a reference
    model), `orpo` (odds-ratio preference plus the chosen completion's NLL, no reference) or `simpo`
    (length-normalised margin, no reference); data.format must be `preference`. The loss is
    averaged over the global batch's pairs; metrics.jsonl gets rewards_chosen, rewards_rejected,
    reward_margin and reward_accuracy (the share of pairs whose chosen reward is higher)."""
    beta: Optional[float] = None
    """The method's β (default 0.1 as TRL for dpo and orpo, whose β is ORPO's λ; 2.0 for simpo, as the SimPO paper)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """dpo only: `sigmoid` (the DPO loss) or `ipo` (squared, on per-token average log-ratios)."""
    label_smoothing: float = 0.0
    """dpo sigmoid and simpo: the share of pairs assumed mislabelled (conservative DPO), in [0, 0.5)."""
    gamma: Optional[float] = None
    """simpo only: the target reward margin γ (default 0.5 as TRL's simpo_gamma; the loss uses γ/β)."""
    reference: Literal["auto", "adapter", "precomputed"] = "auto"
    """dpo only: where the reference log-probabilities come from. `adapter` (LoRA only): the model
    with its adapter disabled, one extra forward without gradient per micro-batch, no second model;
    `precomputed`: one pass over the train and eval data before step 1 with the starting weights,
    on whatever backend is launched, stored beside the prepared data and keyed by the base model,
    so ZeRO-3 and FSDP need no second sharded model and a resume reads them back; `auto`: adapter
    with LoRA, precomputed for full fine-tuning."""


@dataclass
class RewardConfig:
    """An entry of rl.rewards written as a mapping."""
    function: str = ""
    """A reward function: `path/to/file.py:name` (relative to the current folder), `module:name`, or
    a built-in: `exact_match` (the completion equals the row's `column` after normalising case,
    spaces and a final period), `numeric_match` (the last number in the completion equals the
    column's number), `regex` (1.0 where `pattern` matches the completion, else 0.0). A function is
    called as TRL calls one: `f(prompts=..., completions=..., **columns)`, every other column of the
    rows as a keyword, and returns one float (or None: no opinion) per completion."""
    weight: float = 1.0
    """This function's weight in the total reward (a weighted sum; None counts as no term)."""
    column: str = "answer"
    """exact_match and numeric_match: the column holding the expected answer."""
    pattern: Optional[str] = None
    """regex: the pattern searched for in each completion (Python `re`, DOTALL)."""


@dataclass
class RLConfig:
    method: Optional[Literal["grpo"]] = None
    """None: no online RL. `grpo`: each optimizer step samples rl.num_generations completions per
    prompt of its global batch (data.format=prompt) with the policy as it stands, scores them with
    rl.rewards, normalises the rewards within each prompt's group into advantages, and takes the
    clipped policy-gradient loss on them (GRPO and its variants through loss_type and
    importance_sampling). micro_batch_size counts prompts: a micro-batch holds micro_batch_size x
    num_generations completions."""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """How per-token losses are averaged, as TRL 1.16: `dapo` over every completion token of the
    global batch (TRL's default), `grpo` over each completion's tokens then over completions,
    `dr_grpo` summed per completion and divided by max_new_tokens, then over completions."""
    importance_sampling: Literal["token", "sequence"] = "token"
    """The policy ratio per token, or per completion (the geometric mean of its tokens' ratios: GSPO)."""
    num_generations: int = 8
    """Completions sampled per prompt (the group its advantages are normalised in; at least 2)."""
    epsilon: float = 0.2
    """The ratio is clipped below at 1 - epsilon."""
    epsilon_high: Optional[float] = None
    """The ratio is clipped above at 1 + epsilon_high (default epsilon; DAPO's clip-higher uses 0.28)."""
    beta: float = 0.0
    """Weight of the KL term to the reference model (0 as TRL: no reference pass). Above 0 the
    reference is the base with the LoRA adapter disabled (lora.enabled: no second model)."""
    num_iterations: int = 1
    """Optimizer steps taken on each generated batch (the old policy's log-probabilities are kept
    for the ratio); a run's steps count every one of them."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantages are the reward minus its group's mean, divided by the group's standard deviation
    (`group`), the global batch's (`batch`), or not divided (`none`, as Dr. GRPO)."""
    max_new_tokens: int = 256
    """Longest completion; one cut there counts in the share of clipped completions."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens (no stop token) out of the loss, as TRL's key of that
    name (DAPO's overlong filtering); their rewards still count in their group's advantages."""
    temperature: float = 1.0
    """Sampling temperature of the completions (above 0; evaluation samples one answer per eval
    prompt at it, with the same seeds at every evaluation)."""
    top_p: float = 1.0
    """Nucleus sampling: only the most likely tokens whose probabilities sum to top_p are drawn from."""
    top_k: int = 0
    """Only the top_k most likely tokens are drawn from (0: all), as TRL's top_k."""
    min_p: Optional[float] = None
    """Only tokens at least min_p times as likely as the most likely one are drawn from (None: off), as
    TRL's min_p. The cuts apply in transformers' order: temperature, top_k, top_p, min_p."""
    repetition_penalty: float = 1.0
    """Sampling only, as TRL's repetition_penalty: the logits of tokens a completion's prompt or the
    completion so far holds are divided by it where positive and multiplied where negative (above 1
    discourages repeats; 1: off). The log-probabilities the loss uses are not penalised, as in TRL."""
    rewards: list[Union[str, RewardConfig]] = field(default_factory=list)
    """The reward functions (see RewardConfig): names, or mappings with a weight."""
    max_unscored_steps: int = 5
    """Stop, in one line naming the reward functions, after this many generated batches in a row in
    which no completion was scored (every function said None for every one): such a batch teaches
    nothing. The first one is reported when it happens. 0: never stop."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save the full training state every N optimizer steps and at the end (0: no checkpoints,
    except one on preemption)."""
    keep_last: int = 2
    """Keep the newest N complete checkpoints."""
    portable: bool = True
    """Also write the training state any backend and process count can resume from (`portable/`:
    fp32 trainable weights and AdamW moments by name); off saves that space and time, and a resume
    must then use the launch that wrote the checkpoint."""


CHANGEABLE_INPUTS = ("model", "rewards")  # storage/inputs.py records each by content


@dataclass
class Recipe:
    output_dir: str = ""
    """The run folder (`~` is your home folder): metrics, checkpoints, final/. A non-empty one is
    refused unless overwrite=true; a run holds its lock (.toolkit.lock) while it writes."""
    seed: int = 42
    """Same seed and global batch: the same run, on every backend and process count."""
    overwrite: bool = False
    """Let this run replace an earlier toolkit run in output_dir. The old run is removed only once
    this one has passed every check, just before step 1; a folder holding anything else is refused."""
    resume: Optional[str] = None
    """`auto`: continue from the latest complete checkpoint in output_dir (start fresh if none);
    or the path of a checkpoint (or of a run folder) to continue from."""
    resume_new_global_batch: bool = False
    """Let a resume change the global batch (micro_batch_size x gradient_accumulation_steps x
    processes): the data continues at the samples the checkpoint had seen, the schedule at its
    optimizer step (its length from this recipe). Off: another global batch is refused."""
    resume_accept_changed: list[str] = field(default_factory=list)
    """Inputs a resume may find changed since its checkpoint: `model` (the base model's weights and
    config, at model.path) and `rewards` (the code of rl.rewards' functions). Each is recorded by
    content in every checkpoint; a resume that finds one changed is refused, naming it, unless listed
    here. The same content at another path is no change."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model and its tokenizer."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA through peft; enabled: false is full fine-tuning."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and eval data, how it is rendered, labelled and batched."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization, precision, evaluation, logging and what watches the run."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints of the full training state."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """Preference training (DPO, ORPO, SimPO) on data.format=preference pairs; unset: supervised."""
    rl: RLConfig = field(default_factory=RLConfig)
    """Online reinforcement learning (GRPO and its variants) on data.format=prompt rows; unset: none."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe, apply `a.b=value` overrides, build and validate the dataclasses."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "", "recipe file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(source, "", f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                                      "save the recipe as UTF-8") from None
    except IsADirectoryError:
        raise ConfigError(source, "", "is a folder, not a recipe file") from None
    except OSError as e:
        raise ConfigError(source, "", f"cannot read recipe: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(source, "", f"{where}invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(source, "", "a recipe must be a mapping of keys to values")
    given = {}  # key -> the override that set it: a mistake there is the command line's, not the file's
    for item in overrides:
        _apply_override(data, item)
        given[item.partition("=")[0]] = item
    try:
        recipe = _build(Recipe, data, "", source)
        validate(recipe, source)
    except ConfigError as e:
        if e.key not in given:
            raise
        raise ConfigError(f"command line ({given[e.key]})", e.key, e.message) from None
    return recipe


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError("command line", item, "overrides take the form key=value, e.g. train.max_steps=20")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError("command line", key, f"'{part}' is not a section")
    node[parts[-1]] = value


def _build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(source, prefix.rstrip("."), f"expected a section (mapping), got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(source, prefix + str(key),
                              f"unknown key{_suggest(str(key), names)} (known here: {', '.join(sorted(names))})")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        key, hint = prefix + name, hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, data[name], key + ".", source)
        else:
            kwargs[name] = _coerce(data[name], hint, key, source)
    return cls(**kwargs)


# What peers (peft, TRL, the HF Trainer, axolotl) call a key that has another name here.
PEER_NAMES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "lr": "learning_rate",
              "num_train_epochs": "epochs", "per_device_train_batch_size": "micro_batch_size",
              "batch_size": "micro_batch_size", "max_length": "max_seq_len", "sequence_len": "max_seq_len"}


def _suggest(key: str, names: set[str]) -> str:
    """`; did you mean max_steps?` for a near miss here or a peer's name for a key here (`rank` for
    `r`), or the dotted key of a section that has it."""
    import difflib

    if PEER_NAMES.get(key) in names:
        return f"; did you mean {PEER_NAMES[key]}?"
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.75)
    if close:
        return f"; did you mean {close[0]}?"
    sections = {name: hint for name, hint in typing.get_type_hints(Recipe).items() if dataclasses.is_dataclass(hint)}
    elsewhere = [f"{name}.{key}" for name, hint in sections.items()
                 if key in {f.name for f in dataclasses.fields(hint)}]
    return f"; did you mean {elsewhere[0]}?" if elsewhere and key not in names else ""


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".", source)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        if len(choices) == 1:  # Optional[X]: X's own message
            return _coerce(value, choices[0], key, source)
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, dict) and sections:
            return _build(sections[0], value, key + ".", source)
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(source, key, f"expected {_describe(hint)}, got {_kind(value)} {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(source, key, f"must be one of {', '.join(map(str, args))}; got {value!r}")
    if origin is list:
        if isinstance(value, str) and (args[0] is str or str in typing.get_args(args[0])):
            return [value]  # a single path or name is a list of one
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected a list, got {_kind(value)}")
        return [_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected {_describe(hint)}, got {_kind(value)} {value!r}")
        return {_coerce(k, args[0], key, source): _coerce(v, args[1], f"{key}.{k}", source) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 2e-4 as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(source, key, f"must be a finite number, got {value!r}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(source, key, f"expected {_describe(hint)}, got {_kind(value)} {value!r}")


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "mapping", type(None): "nothing"}.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- validation


def validate(r: Recipe, source: str) -> None:
    """Contradictions and out-of-range values, each naming its key."""

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(source, key, message)

    need(bool(r.output_dir), "output_dir", "required: the folder this run writes to")
    r.output_dir = str(Path(r.output_dir).expanduser())  # `~/runs/x` is the home folder's, as in a shell
    if r.model.path is not None and r.model.path.startswith("~"):
        r.model.path = str(Path(r.model.path).expanduser())
    if r.resume not in (None, "auto") and r.resume.startswith("~"):
        r.resume = str(Path(r.resume).expanduser())
    need(0 <= r.seed < 2**32, "seed", f"must be in [0, 2**32), got {r.seed}")
    need(all(x in CHANGEABLE_INPUTS for x in r.resume_accept_changed), "resume_accept_changed",
         f"each must be one of {', '.join(CHANGEABLE_INPUTS)}, got {r.resume_accept_changed!r}")
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
    need(bool(r.data.train_files), "data.train_files", "required: at least one training file")
    for name in ("train_files", "eval_files"):
        for i, e in enumerate(getattr(r.data, name)):
            key = f"data.{name}[{i}]"
            need(e != "" and getattr(e, "path", "x") != "", key + (".path" if not isinstance(e, str) else ""),
                 "required: a file, folder, glob or Hub dataset id")
            if isinstance(e, DataSource):
                need(e.weight is None or e.weight > 0, key + ".weight", f"must be positive, got {e.weight}")
                need(e.weight is None or name == "train_files", key + ".weight", "weights mix training data only")
                need(e.max_rows is None or e.max_rows > 0, key + ".max_rows", f"must be positive, got {e.max_rows}")
    need(r.data.num_proc is None or r.data.num_proc > 0, "data.num_proc", f"must be positive, got {r.data.num_proc}")
    need(r.data.max_seq_len >= 2, "data.max_seq_len", f"must be at least 2, got {r.data.max_seq_len}")
    need(0.0 <= r.data.eval_fraction < 1.0, "data.eval_fraction", f"must be in [0, 1), got {r.data.eval_fraction}")
    need(not (r.data.eval_files and r.data.eval_fraction), "data.eval_fraction",
         "give either data.eval_files or data.eval_fraction, not both")
    t = r.train
    need(t.micro_batch_size > 0, "train.micro_batch_size", f"must be positive, got {t.micro_batch_size}")
    need(t.gradient_accumulation_steps > 0, "train.gradient_accumulation_steps",
         f"must be positive, got {t.gradient_accumulation_steps}")
    need(t.max_steps is None or t.max_steps > 0, "train.max_steps", f"must be positive, got {t.max_steps}")
    need(t.epochs > 0, "train.epochs", f"must be positive, got {t.epochs}")
    need(t.learning_rate > 0, "train.learning_rate", f"must be positive, got {t.learning_rate}")
    need(t.weight_decay >= 0, "train.weight_decay", f"must be non-negative, got {t.weight_decay}")
    need(0 <= t.adam_beta1 < 1, "train.adam_beta1", f"must be in [0, 1), got {t.adam_beta1}")
    need(0 <= t.adam_beta2 < 1, "train.adam_beta2", f"must be in [0, 1), got {t.adam_beta2}")
    need(t.adam_epsilon > 0, "train.adam_epsilon", f"must be positive, got {t.adam_epsilon}")
    need(t.warmup_steps >= 0, "train.warmup_steps", f"must be non-negative, got {t.warmup_steps}")
    need(t.max_steps is None or t.warmup_steps <= t.max_steps, "train.warmup_steps",
         f"{t.warmup_steps} warmup steps exceed train.max_steps={t.max_steps}")
    need(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    need(t.initial_loss_scale >= 1 and math.log2(t.initial_loss_scale).is_integer(), "train.initial_loss_scale",
         f"must be a power of two >= 1 (e.g. 65536), got {t.initial_loss_scale}")
    need(t.loss_chunk_tokens > 0, "train.loss_chunk_tokens", f"must be positive, got {t.loss_chunk_tokens}")
    need(t.max_grad_norm >= 0, "train.max_grad_norm", f"must be non-negative, got {t.max_grad_norm}")
    need(t.eval_every_steps >= 0, "train.eval_every_steps", f"must be non-negative, got {t.eval_every_steps}")
    need(t.eval_batch_size is None or t.eval_batch_size > 0, "train.eval_batch_size",
         f"must be positive, got {t.eval_batch_size}")
    need(t.log_every_steps > 0, "train.log_every_steps", f"must be positive, got {t.log_every_steps}")
    need(all(isinstance(p, str) and p.strip() for p in t.sample_prompts), "train.sample_prompts",
         "must be a list of non-empty strings")
    need(t.sample_max_new_tokens > 0, "train.sample_max_new_tokens",
         f"must be positive, got {t.sample_max_new_tokens}")
    need(t.peak_tflops is None or t.peak_tflops > 0, "train.peak_tflops", f"must be positive, got {t.peak_tflops}")
    need(t.profile_steps is None or (len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1]),
         "train.profile_steps", f"must be [first, last] optimizer steps with 1 <= first <= last, got {t.profile_steps}")
    need(t.watchdog_seconds is None or t.watchdog_seconds > 0, "train.watchdog_seconds",
         f"must be positive, got {t.watchdog_seconds}")
    for tracker, package in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow-skinny"),
                             ("trackio", "trackio")):
        need(tracker not in t.report_to or importlib.util.find_spec(tracker) is not None, "train.report_to",
             f"{tracker} is not installed: " + command(f"python -m pip install {package}"))
    need(t.max_nonfinite_steps > 0, "train.max_nonfinite_steps", f"must be positive, got {t.max_nonfinite_steps}")
    need(r.checkpoint.every_steps >= 0, "checkpoint.every_steps",
         f"must be non-negative, got {r.checkpoint.every_steps}")
    need(r.checkpoint.keep_last > 0, "checkpoint.keep_last", f"must be positive, got {r.checkpoint.keep_last}")
    need(not (r.resume and r.overwrite), "resume", "resume and overwrite=true contradict each other")
    need(r.preference.method is None or r.rl.method is None, "preference.method",
         f"one objective per run: preference.method={r.preference.method} and rl.method={r.rl.method} contradict "
         "each other; remove one")
    validate_preference(r, need)
    validate_rl(r, need)


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


def validate_preference(r: Recipe, need) -> None:
    """The preference section against itself and the data: pairs and a method come together."""
    p = r.preference
    formats = {r.data.format} | {e.format for e in r.data.train_files + r.data.eval_files
                                 if isinstance(e, DataSource) and e.format}
    if p.method is None:
        need("preference" not in formats or r.rl.method is not None, "data.format",
             "preference pairs train only with a preference.method (dpo, orpo or simpo)")
        changed = [f.name for f in dataclasses.fields(PreferenceConfig)
                   if getattr(p, f.name) != getattr(PreferenceConfig(), f.name)]
        need(not changed, f"preference.{changed[0] if changed else ''}",
             "set only with preference.method (dpo, orpo or simpo)")
        return
    need(formats == {"preference"}, "data.format",
         f"preference.method={p.method} trains on pairs: data.format (and every entry's format) must be "
         f"preference, got {', '.join(sorted(formats))}")
    if p.beta is None:
        p.beta = 2.0 if p.method == "simpo" else 0.1
    need(p.beta > 0, "preference.beta", f"must be positive, got {p.beta}")
    need(p.loss_type == "sigmoid" or p.method == "dpo", "preference.loss_type",
         f"a DPO setting; preference.method={p.method} has its own loss")
    need(0.0 <= p.label_smoothing < 0.5, "preference.label_smoothing", f"must be in [0, 0.5), got {p.label_smoothing}")
    need(p.label_smoothing == 0 or (p.method, p.loss_type) in (("dpo", "sigmoid"), ("simpo", "sigmoid")),
         "preference.label_smoothing", "applies to dpo with loss_type=sigmoid and to simpo only")
    need(p.gamma is None or p.method == "simpo", "preference.gamma", f"a SimPO setting, not {p.method}'s")
    if p.method == "simpo" and p.gamma is None:
        p.gamma = 0.5
    need(p.reference == "auto" or p.method == "dpo", "preference.reference",
         f"{p.method} needs no reference model; remove the key")
    need(p.reference != "adapter" or r.lora.enabled, "preference.reference",
         "adapter: the reference is the model with its LoRA adapter disabled, which needs lora.enabled=true")
    if p.method == "dpo" and p.reference == "auto":
        p.reference = "adapter" if r.lora.enabled else "precomputed"
    need(not r.data.packing, "data.packing", "preference pairs are not packed (data.padding_free puts a micro-batch's "
         "sequences in one row without padding)")
    need(not r.data.train_on_prompt, "data.train_on_prompt", "preference losses take completions only")
    need(r.model.router_aux_loss_coef is None, "model.router_aux_loss_coef",
         "not with preference.method: the preference loss has no router term yet")


BUILT_IN_REWARDS = ("exact_match", "numeric_match", "regex")


def validate_rl(r: Recipe, need) -> None:
    """The rl section against itself, the data and the other objectives. A reward function's file
    must exist now; importing it and calling it on the first rows happen when the run starts
    (training/rewards.py), before the model loads."""
    rl = r.rl
    formats = {r.data.format} | {e.format for e in r.data.train_files + r.data.eval_files
                                 if isinstance(e, DataSource) and e.format}
    if rl.method is None:
        need("prompt" not in formats, "data.format", "prompt rows train only with rl.method (grpo)")
        changed = [f.name for f in dataclasses.fields(RLConfig) if getattr(rl, f.name) != getattr(RLConfig(), f.name)]
        need(not changed, f"rl.{changed[0] if changed else ''}", "set only with rl.method (grpo)")
        return
    need(formats == {"prompt"}, "data.format",
         f"rl.method={rl.method} samples completions for prompts: data.format (and every entry's format) must be "
         f"prompt, got {', '.join(sorted(formats))}")
    need(rl.num_generations >= 2, "rl.num_generations",
         f"at least 2 (advantages compare the completions of a prompt), got {rl.num_generations}")
    need(rl.epsilon > 0, "rl.epsilon", f"must be positive, got {rl.epsilon}")
    if rl.epsilon_high is None:
        rl.epsilon_high = rl.epsilon
    need(rl.epsilon_high > 0, "rl.epsilon_high", f"must be positive, got {rl.epsilon_high}")
    need(rl.beta >= 0, "rl.beta", f"must be 0 or more, got {rl.beta}")
    need(rl.beta == 0 or r.lora.enabled, "rl.beta",
         "above 0 the reference is the base with the LoRA adapter disabled, which needs lora.enabled=true "
         "(a frozen copy for full fine-tuning is not built)")
    need(rl.num_iterations >= 1, "rl.num_iterations", f"must be at least 1, got {rl.num_iterations}")
    k = rl.num_iterations
    need(not r.train.max_steps or r.train.max_steps % k == 0, "train.max_steps",
         f"a multiple of rl.num_iterations={k} (a generated batch trains {k} steps), got {r.train.max_steps}")
    need(r.checkpoint.every_steps % k == 0, "checkpoint.every_steps",
         f"a multiple of rl.num_iterations={k}: a checkpoint between a generated batch's steps would not hold "
         f"the batch, got {r.checkpoint.every_steps}")
    need(rl.max_new_tokens > 0, "rl.max_new_tokens", f"must be positive, got {rl.max_new_tokens}")
    need(rl.temperature > 0, "rl.temperature",
         f"must be above 0 (greedy completions of a prompt are all alike: no advantage), got {rl.temperature}")
    need(0 < rl.top_p <= 1, "rl.top_p", f"must be in (0, 1], got {rl.top_p}")
    need(rl.top_k >= 0, "rl.top_k", f"must be 0 (off) or a number of tokens, got {rl.top_k}")
    need(rl.repetition_penalty > 0, "rl.repetition_penalty", f"must be above 0 (1: off), got {rl.repetition_penalty}")
    need(rl.max_unscored_steps >= 0, "rl.max_unscored_steps", f"must be 0 (never stop) or more, got "
         f"{rl.max_unscored_steps}")
    need(rl.min_p is None or 0 <= rl.min_p <= 1, "rl.min_p", f"must be in [0, 1], got {rl.min_p}")
    need(bool(rl.rewards), "rl.rewards", "give at least one reward function (file.py:name, module:name or "
         + ", ".join(BUILT_IN_REWARDS) + ")")
    rl.rewards = [e if isinstance(e, RewardConfig) else RewardConfig(function=e) for e in rl.rewards]
    for i, e in enumerate(rl.rewards):
        key = f"rl.rewards[{i}]"
        need(math.isfinite(e.weight), f"{key}.weight", f"must be a finite number, got {e.weight}")
        name, sep, attr = e.function.rpartition(":")
        if e.function in BUILT_IN_REWARDS:
            need(e.function != "regex" or bool(e.pattern), f"{key}.pattern", "the regex reward needs a pattern")
            need(e.function == "regex" or e.pattern is None, f"{key}.pattern",
                 f"only the built-in regex reward takes a pattern; {e.function} compares with the row's "
                 f"{e.column!r} column")
            need(e.function == "regex" or e.column.strip() != "", f"{key}.column",
                 f"empty: {e.function} needs the name of the column holding the expected answer")
            if e.pattern:
                try:
                    re.compile(e.pattern)
                except re.error as err:
                    need(False, f"{key}.pattern", f"not a regular expression: {err}")
            continue
        need(e.pattern is None, f"{key}.pattern", "only the built-in regex reward takes a pattern")
        need(bool(sep and name and attr.isidentifier()), f"{key}.function",
             f"{e.function!r}: give path/to/file.py:function, module:function or a built-in "
             f"({', '.join(BUILT_IN_REWARDS)})")
        if name.endswith(".py"):
            need(Path(name).expanduser().is_file(), f"{key}.function", f"file not found: {name}")
    need(any(e.weight != 0 for e in rl.rewards), "rl.rewards",
         "every weight is 0: every completion would get the same reward and nothing would be learned")
    need(not r.data.packing and not r.data.padding_free, "data.packing" if r.data.packing else "data.padding_free",
         "prompt rows are not packed: each step makes its own completions")
    need(not r.data.train_on_prompt, "data.train_on_prompt",
         "prompt rows have no targets: the sampled completions are what trains; remove the key")
    need(r.model.router_aux_loss_coef is None, "model.router_aux_loss_coef",
         "not with rl.method: the policy loss has no router term")


def dump_recipe(r: Recipe) -> str:
    return yaml.safe_dump(r.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------- key reference


def key_reference() -> str:
    """Every recipe key with its type, default and meaning, as Markdown (docs/recipe-keys.md is this,
    kept in sync by a test). The meanings are the attribute docstrings of the dataclasses above."""
    import ast

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    nodes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def docs(cls_name: str) -> dict[str, str]:
        body, found = nodes[cls_name].body, {}
        for node, after in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)):
                found[node.target.id] = " ".join(after.value.value.split())
        return found

    def shown(kind) -> str:
        text = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
        return "`" + text.replace("toolkit.config.", "").replace("|", "\\|") + "`"

    def default(f: dataclasses.Field) -> str:
        if f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            return "" if dataclasses.is_dataclass(value) else f"`{value!r}`"
        return f"`{f.default!r}`"

    lines = ["# Recipe keys", "",
             "Generated from the docstrings of `toolkit/config.py` by `make docs`; a test keeps it in sync.",
             "Set a key in the recipe YAML or on the command line as a dotted override (`train.max_steps=20`).", ""]

    def table(cls, prefix: str, title: str) -> None:
        meaning = docs(cls.__name__)
        lines.extend([f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"])
        nested = []
        for f in dataclasses.fields(cls):
            kind = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(kind):
                nested.append((kind, f"{prefix}{f.name}.", f"`{f.name}`: {meaning.get(f.name, '')}"))
                continue
            text = meaning.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | {shown(kind)} | {default(f)} | {text} |")
        lines.append("")
        for kind, sub, sub_title in nested:
            table(kind, sub, sub_title)

    table(Recipe, "", "Top level")
    for cls, title, prefix in ((DataSource, "Entries of data.train_files / data.eval_files written as mappings", ""),
                               (RewardConfig, "Entries of rl.rewards written as mappings", ""),
                               (RopeScaling, "`model.rope_scaling`: " + docs_of(RopeScaling), "model.rope_scaling.")):
        lines.extend([f"## {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"])
        meaning = docs(cls.__name__)
        for f in dataclasses.fields(cls):
            text = meaning.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | {shown(typing.get_type_hints(cls)[f.name])} | "
                         f"{default(f)} | {text} |")
        lines.append("")
    return "\n".join(lines[:-1]) + "\n"


def docs_of(cls) -> str:
    return " ".join((cls.__doc__ or "").split())
