"""The objectives' sections: `preference` (DPO, ORPO, SimPO), `rl` (online RL) and its rewards, and the
reward functions built in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

# TRL 1.16's DPOConfig.loss_type names (training/dpo_losses.py computes each).
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# The preference keys of DPO's own loss types, named as TRL's DPOConfig names them (training/dpo_losses.py takes
# them; TRL configs map them by name).
DPO_OPTIONS = ("loss_weights", "discopop_tau", "f_divergence_type", "f_alpha_divergence_coef")
# The loss types built on the chosen-rejected reward difference: the only ones f-DPO generalises (TRL's set).
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")


@dataclass
class PreferenceConfig:
    method: Optional[Literal["dpo", "orpo", "simpo", "kto", "reward"]] = None
    """None: supervised fine-tuning. `dpo` (Direct Preference Optimization, against a reference
    model), `orpo` (odds-ratio preference plus the chosen completion's NLL, no reference) or `simpo`
    (length-normalised margin, no reference); data.format must be `preference`. The loss is
    averaged over the global batch's pairs; metrics.jsonl gets rewards_chosen, rewards_rejected,
    reward_margin and reward_accuracy (the share of pairs whose chosen reward is higher). Or `kto`
    (Kahneman-Tversky Optimization, TRL's KTOTrainer, against a reference model): data.format must be
    `unpaired`, each row one completion labelled desirable or not; the loss is averaged over the
    global batch's completions; metrics.jsonl gets kl, rewards_chosen and rewards_rejected (the mean
    implied reward of the desirable and the undesirable completions) and reward_margin. Or `reward`
    (a reward model, TRL's RewardTrainer): a sequence-classification head with one output on the
    model, trained on the pairs (data.format=preference) with the Bradley-Terry loss; final/ loads
    as AutoModelForSequenceClassification and serves as an rl.rewards model; metrics.jsonl gets
    rewards_chosen, rewards_rejected, reward_margin and reward_accuracy of its scores."""
    beta: Optional[float] = None
    """The method's β (default 0.1 as TRL for dpo, orpo and kto, whose β is ORPO's λ; 2.0 for simpo, as the SimPO
    paper)."""
    loss_type: Union[str, list[str]] = "sigmoid"
    """dpo: TRL 1.16's DPOConfig.loss_type, a name or a list of names whose losses are added
    (preference.loss_weights): `sigmoid` (the DPO loss), `hinge`, `ipo` (squared, on per-token average
    log-ratios), `exo_pair`, `nca_pair`, `robust`, `bco_pair`, `sppo_hard`, `aot`, `aot_unpaired`,
    `apo_zero`, `apo_down`, `discopop`, `sft` (the chosen completion's NLL, averaged over its tokens),
    `sigmoid_norm` (docs/preference.md); aot and aot_unpaired sort the log-ratios of a micro-batch's
    pairs, so their loss depends on the micro-batches, as TRL's on its per-device batch. kto: `kto` (the
    default `sigmoid` reads as kto: the implied reward against the KL estimate) or `apo_zero_unpaired`
    (APO-zero's unpaired form: desirable rewards pushed up, undesirable down, no KL estimate). The other
    methods have their own loss."""
    loss_weights: Optional[list[float]] = None
    """dpo only: the weight of each of preference.loss_type's losses, one per name, in its order (TRL's
    key of that name: MPO combines sigmoid, bco_pair and sft with [0.8, 0.2, 1.0]); None: 1.0 each.
    Each 0 or more, at least one above 0."""
    label_smoothing: float = 0.0
    """dpo and simpo: the share of pairs assumed mislabelled, in [0, 0.5): dpo's sigmoid (conservative
    DPO; TRL 1.16's sigmoid has none), robust (the flip rate; the Robust DPO paper uses 0.1), exo_pair
    (EXO's ε, needed above 0; the paper uses 1e-3), aot and aot_unpaired; simpo's loss."""
    discopop_tau: float = 0.05
    """dpo with loss_type discopop: DiscoPOP's temperature τ, the shape of its log-ratio modulated loss
    (TRL's key of that name and default, the paper's)."""
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = "reverse_kl"
    """dpo: the divergence to the reference the loss regularises with (f-DPO, TRL's key of that name):
    `reverse_kl` (DPO's own), `forward_kl`, `js_divergence` or `alpha_divergence`; other than reverse_kl
    only with loss types built on the chosen-rejected reward difference (sigmoid, sigmoid_norm, hinge,
    ipo, exo_pair, robust, discopop, sft), as TRL's. The logged rewards stay β x the log-ratios."""
    f_alpha_divergence_coef: float = 0.5
    """dpo with f_divergence_type alpha_divergence: its α (TRL's key of that name and default)."""
    gamma: Optional[float] = None
    """simpo only: the target reward margin γ (default 0.5 as TRL's simpo_gamma; the loss uses γ/β)."""
    desirable_weight: float = 1.0
    """kto only: the weight of a desirable completion's loss (TRL's key of that name; with fewer
    desirable than undesirable rows, the KTO paper's range is undesirable/desirable rows x 1 to 1.33)."""
    undesirable_weight: float = 1.0
    """kto only: the weight of an undesirable completion's loss (TRL's key of that name)."""
    center_rewards_coefficient: Optional[float] = None
    """reward only: adds this times the squared sum of each pair's two scores to its loss, so the
    scores stay centred on 0 (TRL's key of that name; the reward-modelling paper of Eisenstein et
    al. uses 0.01); None: not added."""
    reference: Literal["auto", "adapter", "precomputed"] = "auto"
    """dpo and kto: where the reference log-probabilities come from. `adapter` (LoRA only): the model
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
    model: Optional[str] = None
    """Instead of a function, a reward model: a sequence-classification model folder (or Hub id), as
    TRL's reward models. Each completion's reward is its first logit on the prompt + completion
    text, a chat prompt rendered with the reward model's own chat template (the completion as the
    assistant's message); scored in one batch on this process's device, in the folder's dtype, a
    whole copy on every rank (ZeRO-3 and FSDP do not shard it). Its metric is reward_<folder name>."""
    weight: float = 1.0
    """This function's weight in the total reward (a weighted sum; None counts as no term)."""
    column: str = "answer"
    """exact_match and numeric_match: the column holding the expected answer."""
    pattern: Optional[str] = None
    """regex: the pattern searched for in each completion (Python `re`, DOTALL)."""



BUILT_IN_REWARDS = ("exact_match", "numeric_match", "regex")


def server_flag(arg: str) -> str:
    """A server argument's flag as vLLM's parser reads it: `--served_model_name=x` is `--served-model-name`, and
    `--device-memory-utilization` (its alias) `--gpu-memory-utilization`."""
    if not str(arg).startswith("--"):
        return str(arg)
    flag = "--" + str(arg).split("=")[0].lstrip("-").replace("_", "-")
    return {"--device-memory-utilization": "--gpu-memory-utilization"}.get(flag, flag)


def server_arg(args: list, flag: str) -> str | None:
    """The value given to a server flag in rl.vllm_args (`--flag value` or `--flag=value`), None if not given."""
    args = [str(a) for a in args]
    for i, a in enumerate(args):
        if server_flag(a) == flag:
            return a.split("=", 1)[1] if "=" in a else args[i + 1] if i + 1 < len(args) else ""
    return None


def default_vllm_python() -> Path:
    """The Python of `make vllm`'s environment (.venv-vllm beside this package's source)."""
    return Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@dataclass
class RLConfig:
    method: Optional[Literal["grpo", "rloo", "distill"]] = None
    """None: no online RL. `grpo`: each optimizer step samples rl.num_generations completions per
    prompt of its global batch (data.format=prompt) with the policy as it stands, scores them with
    rl.rewards, normalises the rewards within each prompt's group into advantages, and takes the
    clipped policy-gradient loss on them (GRPO and its variants through loss_type and
    importance_sampling). `rloo` (TRL's RLOOTrainer): the same sampling and rewards; each
    completion's advantage is its reward minus the mean of its group's other completions'
    (leave-one-out), with rl.beta's KL to the reference subtracted from the reward, and the clipped
    loss is taken on each completion's whole log-probability (one ratio per completion), averaged
    over completions. `distill` (TRL's DistillationTrainer, on-policy distillation): the policy (the
    student) samples completions for the prompts as above, and the loss is the generalized
    Jensen-Shannon divergence (rl.beta) between its next-token distribution and rl.teacher's at
    every completion token, at rl.temperature, averaged over the global batch's completion tokens;
    no rewards. micro_batch_size counts prompts: a micro-batch holds micro_batch_size x
    num_generations completions."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "cispo"] = "dapo"
    """How per-token losses are averaged, as TRL 1.16: `dapo` over every completion token of the
    global batch (TRL's default), `grpo` over each completion's tokens then over completions,
    `dr_grpo` summed per completion and divided by max_new_tokens, then over completions. `cispo`
    (ScaleRL's CISPO) clips the importance weight instead of the surrogate: each token's loss is
    -min(ratio, epsilon_high) x advantage x log-probability with the weight's gradient stopped,
    averaged as `dapo`; it needs rl.epsilon_high set (ScaleRL recommends 5.0)."""
    importance_sampling: Literal["token", "sequence"] = "token"
    """The policy ratio per token, or per completion (the geometric mean of its tokens' ratios: GSPO)."""
    num_generations: Optional[int] = None
    """Completions sampled per prompt (the group its advantages are normalised in: at least 2 for grpo and rloo).
    None: 8 for grpo and rloo, 1 for distill (TRL's DistillationTrainer samples one per prompt)."""
    teacher: Optional[str] = None
    """distill only: the teacher, a causal LM folder (or Hub id) whose next-token distribution the
    student learns (TRL's teacher_model_name_or_path). It must share the student's vocabulary (its
    tokenizer, where the folder has one, must equal the student's). Loaded in train.precision's dtype,
    frozen, and prepared by the launched backend as TRL prepares it: sharded under ZeRO-3 and FSDP2,
    a whole copy on every rank otherwise."""
    epsilon: float = 0.2
    """The ratio is clipped below at 1 - epsilon."""
    epsilon_high: Optional[float] = None
    """The ratio is clipped above at 1 + epsilon_high (default epsilon; DAPO's clip-higher uses 0.28);
    under loss_type cispo the importance weight is capped at epsilon_high itself."""
    delta: Optional[float] = None
    """Two-sided clipping (INTELLECT-2, TRL's `delta`): the unclipped ratio in the surrogate is capped
    at delta too, so a negative advantage cannot push a ratio up without bound; above 1 (TRL
    recommends above 1 + epsilon_high). None: one-sided, as GRPO."""
    beta: Optional[float] = None
    """grpo and rloo: the weight of the KL term to the reference model (None: 0, as TRL's GRPO: no
    reference pass; TRL's RLOO default is 0.05). Above 0 the reference is the base with the LoRA
    adapter disabled (lora.enabled: no second model), or with full fine-tuning a frozen copy of the
    base loaded from model.path in the policy's model.dtype (TRL's ref_model, sharded as the launch
    shards a frozen model). grpo adds beta x KL per token to the loss; rloo
    subtracts beta x each completion's summed log-ratio to the reference from its reward, as TRL's.
    distill: TRL's DistillationConfig.beta, which divergence: 0 the forward KL(teacher || student),
    1 the reverse KL(student || teacher) (None: 1, TRL's default), between them the generalized JSD
    with the mixture (1 - beta) x student + beta x teacher."""
    normalize_advantages: bool = False
    """rloo: the advantages standardised over the global batch (minus their mean, divided by their
    std + 1e-4), TRL's RLOO key of that name."""
    reward_clip_range: Optional[list[float]] = None
    """rloo: [low, high] each completion's total reward is clipped to before the KL and the
    baseline, TRL's RLOO key of that name; None: not clipped."""
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
    prompt at it, with the same seeds at every evaluation). The loss's log-probabilities are of the
    logits divided by it too, as TRL's (distill: the student's and the teacher's both)."""
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
    tools: list[str] = field(default_factory=list)
    """grpo and rloo: Python functions the policy may call while it samples (TRL's `tools`):
    `path/to/file.py:name` (relative to the current folder) or `module:name`, as rewards are named. Each
    needs type hints and a docstring with an `Args:` line per argument: its schema goes into the chat
    template's `tools`, so prompts must be chat messages and the tokenizer's template must render tool
    calls (its response schema read as TRL reads it). A completion's calls are parsed, each run and its
    result appended as a tool message, and sampling goes on until an answer without a call, the
    iteration limit or rl.max_new_tokens (tool tokens included). Tool-result tokens are never in the
    loss or the entropy (TRL's tool mask); reward functions get the whole conversation as messages. A
    tool that raises, an unknown tool or arguments that do not fit give TRL's error message as the
    tool's answer; metrics.jsonl gets tool_call_frequency and tool_failure_frequency."""
    environment: Optional[Union[str, dict[str, str]]] = None
    """grpo and rloo: an environment the policy acts on through tool calls (TRL's `environment_factory`):
    `FILE.py:Class` (or `module:Class`), or a mapping of names to them, each row's `environment` column
    picking one. Each rollout gets its own instance (pooled per process, reset every batch with
    `reset(**row)`; a text it returns is appended to the prompt's last message); its public methods
    (type hints and a docstring with an `Args:` line per argument) are that rollout's tools beside
    rl.tools; a `get_reward()` method adds a reward named after the class, weight 1. Reward
    functions get `environments=` (one instance per completion). Prompts must be chat messages.
    None: no environment."""
    max_tool_calling_iterations: Optional[int] = None
    """rl.tools: tool rounds per completion at most (a round runs every call of a turn, then samples
    the next turn); None: until an answer without a call or rl.max_new_tokens is spent (TRL's key)."""
    tool_timeout: Optional[float] = 30.0
    """rl.tools: seconds one tool call may take; past it the call's answer is `{'error': 'Tool NAME timed
    out after T seconds.'}`, counted in tool_timeouts (its thread is left running). None: no limit, as
    TRL (which has no timeout)."""
    max_unscored_steps: int = 5
    """Stop, in one line naming the reason, after this many generated batches in a row that teach
    nothing: no completion was scored (every function said None for every one), or every scored
    completion was cut at max_new_tokens and left out (mask_truncated_completions). The first one is
    reported when it happens; a batch without advantages (every group scored alike) is reported once
    and not counted. 0: never stop."""
    top_entropy_quantile: float = 1.0
    """Only the tokens whose entropy is in this top share of the global batch's completion tokens get
    the policy term (TRL's top_entropy_quantile, "Beyond the 80/20 Rule": 0.2 keeps the 20% most
    uncertain tokens; the KL term still counts on every token); 1: every token. The threshold is
    taken over the whole global batch, with one extra forward without gradient per step, so it does
    not depend on micro-batches or ranks (TRL takes it per micro-batch: equal where the global batch
    is one micro-batch on one process)."""
    num_generations_eval: Optional[int] = None
    """Completions sampled per eval prompt; eval_reward is their mean reward. None: one (TRL's
    default is num_generations)."""
    log_completions: bool = False
    """Append every generated completion to completions.jsonl in the run folder (TRL's
    log_completions): step, prompt, completion, reward and each function's (null: no opinion),
    advantage, and the columns reward functions gave log_extra. A row per completion of every step:
    about (prompt + completion text) x num_generations x prompts per step."""
    num_completions_to_print: Optional[int] = None
    """With rl.log_completions: how many of each generated batch's completions the log also shows, with
    their rewards and advantages (TRL's num_completions_to_print; None: all of them, as TRL; 0: none)."""
    gather_for_sampling: bool = True
    """ZeRO-3 and FSDP2: gather the whole weights once for each sampling and keep them on every rank until
    it ends (TRL's ds3_gather_for_generation, default true: fastest). false: each forward of sampling
    gathers one layer at a time and frees it, as training's forward does, so a model that fits only
    sharded can sample, at the cost of a gather per layer per token. Completions and what is learned are
    the same either way; `toolkit estimate` shows which fits. Other backends hold whole weights anyway."""
    sampler: Literal["toolkit", "vllm"] = "toolkit"
    """Who samples the completions. `toolkit`: the trained model itself, seeded per completion, the same
    completions on every backend (docs/rl.md). `vllm`: a vLLM server (TRL's use_vllm with vllm_mode server)
    that the run starts from `make vllm`'s environment (rl.vllm_python) and stops at its end, or the one at
    rl.vllm_url; the LoRA adapter (or, in full fine-tuning, the weights) is loaded into it before each generated
    batch, and the loss is corrected for its log-probabilities (rl.vllm_importance_sampling_*). grpo and rloo."""
    max_staleness: int = 0
    """rl.sampler: vllm: how many optimizer steps the weights a batch is sampled with may lag behind the
    trained ones, so that the server samples later steps' batches while this one trains (TRL's
    AsyncGRPOTrainer). 0: each batch is sampled with the weights as its step starts (on-policy). s >= 1:
    the batch of step k is sampled with the weights after step max(k - 1 - s, 0), in a thread of its
    own that starts once those weights are in the server and runs while the steps between train; the
    loss's correction (rl.vllm_importance_sampling_correction, needed here) covers the lag, and
    metrics.jsonl's `staleness` says each batch's. Unlike TRL's, whose lag is whatever the timing
    gives up to the bound, the lag is always s (less in the first steps), so a run is reproducible and
    resumes exactly: a checkpoint holds the batches sampled ahead. On one server, 1 overlaps all
    there is to overlap (the weights are loaded between batches); more only adds lag. grpo and rloo,
    one iteration per batch, no rl.environment."""
    vllm_url: Optional[str] = None
    """A running vLLM server (http://HOST:PORT, TRL's vllm_server_base_url) serving this run's model.path with
    --logprobs-mode processed_logprobs, and with LoRA --enable-lora and runtime LoRA updating on, in full
    fine-tuning our worker extension (docs/rl.md); None: the run starts its own on a loopback port, logged to
    vllm.log in the run folder."""
    vllm_python: Optional[str] = None
    """The Python of the vLLM environment the run starts its server with (None: `make vllm`'s .venv-vllm)."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra arguments to the server the run starts (e.g. [--max-num-seqs, "64"])."""
    vllm_timeout: float = 240.0
    """Seconds to wait for the server to come up, and for each generated batch (TRL's vllm_server_timeout)."""
    vllm_importance_sampling_correction: bool = True
    """Correct the loss for the server sampling from slightly other probabilities than the trained model's
    (TRL's key of that name, on by default): one more forward without gradient per generated batch."""
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        "sequence_mask"
    """TRL's: per token or per completion, the ratio clipped into the bounds (truncate) or zeroed outside them
    (mask)."""
    vllm_importance_sampling_clip_min: Optional[float] = None
    """TRL's lower bound of the ratio (None: none)."""
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    """TRL's upper bound of the ratio (None: none)."""
    disable_dropout: bool = False
    """Set every dropout layer's rate to 0 (TRL's `disable_dropout`, off by default as in TRL), LoRA's
    included, so that the loss, the old-policy and the reference passes see the same network and a
    ratio of 1 means an unchanged policy. Sampling always runs without dropout."""
