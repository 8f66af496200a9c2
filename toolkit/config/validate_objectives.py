"""Validation of the objectives: the preference section and the rl section, each against itself, the
data and the other objective."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from .data import DataSource
from .objectives import (
    BUILT_IN_REWARDS,
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    PreferenceConfig,
    RewardConfig,
    RLConfig,
    default_vllm_python,
    server_arg,
    server_flag,
)
from .recipe import Recipe


def validate_preference(r: Recipe, need) -> None:
    """The preference section against itself and the data: pairs and a method come together."""
    p = r.preference
    if r.data.format is None and p.method is not None:  # unset: what the method trains on
        r.data.format = "unpaired" if p.method == "kto" else "preference"
    formats = {r.data.format} - {None} | {e.format for e in r.data.train_files + r.data.eval_files
                                          if isinstance(e, DataSource) and e.format}
    other = p.method and f"preference.method={p.method}" or r.rl.method and f"rl.method={r.rl.method}"
    need(r.train.loss_type == "nll" or not other, "train.loss_type",
         f"{r.train.loss_type} is supervised fine-tuning's loss; {other} has its own: remove the key")
    if p.method is None:
        need("preference" not in formats or r.rl.method is not None, "data.format",
             "preference pairs train only with a preference.method (dpo, orpo, simpo or reward)")
        need("unpaired" not in formats, "data.format", "unpaired rows train only with preference.method=kto")
        changed = [f.name for f in dataclasses.fields(PreferenceConfig)
                   if getattr(p, f.name) != getattr(PreferenceConfig(), f.name)]
        need(not changed, f"preference.{changed[0] if changed else ''}",
             "set only with preference.method (dpo, orpo, simpo, kto or reward)")
        return
    wanted = "unpaired" if p.method == "kto" else "preference"
    need(formats == {wanted}, "data.format",
         f"preference.method={p.method} trains on "
         + ("unpaired rows (prompt, completion, label)" if p.method == "kto" else "pairs")
         + f": data.format (and every entry's format) must be {wanted}, got {', '.join(sorted(formats))}"
         + (" (write each pair as two rows: prompt and chosen with label true, prompt and rejected with label false)"
            if p.method == "kto" and "preference" in formats else ""))
    if p.method == "reward":  # a score per sequence, no policy: none of the policy objectives' settings apply
        validate_reward_model(r, need)
        return
    if p.beta is None:
        p.beta = 2.0 if p.method == "simpo" else 0.1
    need(p.beta > 0, "preference.beta", f"must be positive, got {p.beta}")
    need(p.center_rewards_coefficient is None, "preference.center_rewards_coefficient",
         f"a reward-model setting (preference.method=reward), not {p.method}'s")
    loss_types = {"dpo": DPO_LOSS_TYPES, "kto": ("kto", "apo_zero_unpaired")}
    default = PreferenceConfig.loss_type  # `sigmoid`, from before KTO: recipes and run folders of then keep it
    if p.method == "kto" and p.loss_type == default:
        p.loss_type = "kto"
    names = [p.loss_type] if isinstance(p.loss_type, str) else list(p.loss_type)
    need(p.loss_type == default or p.method in loss_types, "preference.loss_type",
         f"a DPO or KTO setting; preference.method={p.method} has its own loss")
    need(bool(names) and (p.method == "dpo" or isinstance(p.loss_type, str)), "preference.loss_type",
         "one name, or for dpo a list of names (combined with preference.loss_weights)")
    wrong = [n for n in names if n not in loss_types.get(p.method, names)]
    known = loss_types.get(p.method, ("",))
    choices = " or ".join([", ".join(known[:-1]), known[-1]] if known[:-1] else known)
    need(not wrong, "preference.loss_type", f"preference.method={p.method} takes {choices}, got {', '.join(wrong)}")
    need(len(set(names)) == len(names), "preference.loss_type", f"a loss type named twice: {', '.join(names)}")
    w = p.loss_weights
    need(w is None or p.method == "dpo", "preference.loss_weights", f"a DPO setting, not {p.method}'s")
    need(w is None or len(w) == len(names), "preference.loss_weights",
         f"one weight per preference.loss_type name: {len(names)} name(s) ({', '.join(names)}), "
         f"got {len(w or [])} weight(s)")
    need(w is None or (all(math.isfinite(x) and x >= 0 for x in w) and any(x > 0 for x in w)),
         "preference.loss_weights", f"finite weights of 0 or more, at least one above 0 (a negative weight makes "
         f"the run maximise that loss), got {w}")
    need(p.discopop_tau == PreferenceConfig.discopop_tau or "discopop" in names, "preference.discopop_tau",
         "a setting of preference.loss_type discopop only")
    need(p.discopop_tau > 0, "preference.discopop_tau", f"must be positive, got {p.discopop_tau}")
    need(p.f_divergence_type == "reverse_kl" or p.method == "dpo", "preference.f_divergence_type",
         f"a DPO setting, not {p.method}'s")
    outside = [n for n in names if n not in F_DIVERGENCE_LOSS_TYPES]
    need(p.f_divergence_type == "reverse_kl" or not outside, "preference.f_divergence_type",
         f"{p.f_divergence_type} is defined only for loss_type {', '.join(F_DIVERGENCE_LOSS_TYPES)}, as TRL's; "
         f"not {', '.join(outside)}")
    need(p.f_alpha_divergence_coef == PreferenceConfig.f_alpha_divergence_coef
         or p.f_divergence_type == "alpha_divergence", "preference.f_alpha_divergence_coef",
         "a setting of preference.f_divergence_type alpha_divergence only")
    need(0.0 <= p.label_smoothing < 0.5, "preference.label_smoothing", f"must be in [0, 0.5), got {p.label_smoothing}")
    smoothed = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
    need(p.label_smoothing == 0 or (p.method == "dpo" and set(smoothed) & set(names)) or p.method == "simpo",
         "preference.label_smoothing",
         "applies to dpo with loss_type sigmoid, robust, exo_pair, aot or aot_unpaired and to simpo only")
    need("exo_pair" not in names or p.label_smoothing > 0, "preference.label_smoothing",
         "loss_type exo_pair needs it above 0 (EXO's ε; the paper recommends 1e-3), as TRL's")
    need(p.gamma is None or p.method == "simpo", "preference.gamma", f"a SimPO setting, not {p.method}'s")
    if p.method == "simpo" and p.gamma is None:
        p.gamma = 0.5
    for name in ("desirable_weight", "undesirable_weight"):
        value = getattr(p, name)
        need(p.method == "kto" or value == 1.0, f"preference.{name}", f"a KTO setting, not {p.method}'s")
        need(math.isfinite(value) and value > 0, f"preference.{name}", f"must be a positive number, got {value}")
    need(p.reference == "auto" or p.method in ("dpo", "kto"), "preference.reference",
         f"{p.method} needs no reference model; remove the key")
    need(p.reference != "adapter" or r.lora.enabled, "preference.reference",
         "adapter: the reference is the model with its LoRA adapter disabled, which needs lora.enabled=true")
    if p.method in ("dpo", "kto") and p.reference == "auto":
        p.reference = "adapter" if r.lora.enabled else "precomputed"
    need(not r.data.packing, "data.packing", "preference pairs are not packed (data.padding_free puts a micro-batch's "
         "sequences in one row without padding)")
    need(not r.data.train_on_prompt, "data.train_on_prompt", "preference losses take completions only")
    need(r.model.router_aux_loss_coef is None, "model.router_aux_loss_coef",
         "not with preference.method: the preference loss has no router term yet")


def validate_reward_model(r: Recipe, need) -> None:
    """preference.method=reward: the pairs score through a sequence-classification head, whose score
    is read at each sequence's last token (transformers' pooling), so every sequence has a row of its
    own; none of the policy objectives' keys mean anything here."""
    p, default = r.preference, PreferenceConfig()
    for name in ("beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau", "f_divergence_type",
                 "f_alpha_divergence_coef", "gamma", "desirable_weight", "undesirable_weight", "reference"):
        need(getattr(p, name) == getattr(default, name), f"preference.{name}",
             "not a reward-model setting: a reward model has no policy, reference or β; remove it")
    c = p.center_rewards_coefficient
    need(c is None or (math.isfinite(c) and c >= 0), "preference.center_rewards_coefficient",
         f"must be 0 or more, got {c}")
    need(not r.data.packing and not r.data.padding_free, "data.padding_free" if r.data.padding_free else "data.packing",
         "a reward model reads its score at each sequence's last token (transformers' sequence-classification "
         "pooling), which needs a row per sequence; leave it off")
    need(not r.data.train_on_prompt, "data.train_on_prompt", "a reward model scores whole sequences; remove it")
    need(not r.lora.enabled, "lora.enabled", "a reward model trains fully for now: a LoRA one's final/ would be an "
         "adapter that rl.rewards, toolkit merge and AutoModelForSequenceClassification do not load yet; set it false")
    need(r.model.kernels == "none", "model.kernels", "Liger's kernels patch causal LMs only, not a reward model's "
         "sequence-classification class; remove it")
    need(not r.train.sample_prompts, "train.sample_prompts", "a reward model does not generate; remove it")
    need(r.model.router_aux_loss_coef is None, "model.router_aux_loss_coef",
         "not with preference.method: the preference loss has no router term yet")


def validate_rl(r: Recipe, need) -> None:
    """The rl section against itself, the data and the other objectives. A reward function's file
    must exist now; importing it and calling it on the first rows happen when the run starts
    (training/rewards.py), before the model loads."""
    rl = r.rl
    if r.data.format is None and rl.method is not None:  # unset: what online RL samples for
        r.data.format = "prompt"
    formats = {r.data.format} - {None} | {e.format for e in r.data.train_files + r.data.eval_files
                                          if isinstance(e, DataSource) and e.format}
    if rl.method is None:
        need("prompt" not in formats, "data.format", "prompt rows train only with rl.method (grpo, rloo or distill)")
        # Unset, these read as grpo's defaults, as every run folder before distillation recorded them (a resume
        # of one, or its config.yaml loaded again, sees the same values).
        rl.beta = 0.0 if rl.beta is None else rl.beta
        rl.num_generations = 8 if rl.num_generations is None else rl.num_generations
        default = dataclasses.replace(RLConfig(), beta=0.0, num_generations=8)
        changed = [f.name for f in dataclasses.fields(RLConfig) if getattr(rl, f.name) != getattr(default, f.name)]
        need(not changed, f"rl.{changed[0] if changed else ''}", "set only with rl.method (grpo, rloo or distill)")
        return
    need(formats == {"prompt"}, "data.format",
         f"rl.method={rl.method} samples completions for prompts: data.format (and every entry's format) must be "
         f"prompt, got {', '.join(sorted(formats))}")
    default = RLConfig()
    if rl.method == "distill":
        validate_distill(r, need)
        return
    need(rl.teacher is None, "rl.teacher", "a distillation setting (rl.method=distill); remove it")
    if rl.beta is None:
        rl.beta = 0.0
    if rl.num_generations is None:
        rl.num_generations = 8
    if rl.method == "rloo":  # GRPO's loss settings have no meaning under RLOO's sequence-level loss
        for name in ("loss_type", "importance_sampling", "scale_rewards", "delta", "top_entropy_quantile"):
            need(getattr(rl, name) == getattr(default, name), f"rl.{name}",
                 "a GRPO setting: rloo's loss is TRL's RLOO (one ratio per completion, leave-one-out advantages); "
                 "remove it")
    else:
        for name in ("normalize_advantages", "reward_clip_range"):
            need(getattr(rl, name) == getattr(default, name), f"rl.{name}", "an RLOO setting (rl.method=rloo)")
    need(rl.reward_clip_range is None or (len(rl.reward_clip_range) == 2
                                          and rl.reward_clip_range[0] < rl.reward_clip_range[1]),
         "rl.reward_clip_range", f"[low, high] with low below high, got {rl.reward_clip_range}")
    need(rl.num_generations >= 2, "rl.num_generations",
         f"at least 2 (advantages compare the completions of a prompt), got {rl.num_generations}")
    need(rl.epsilon > 0, "rl.epsilon", f"must be positive, got {rl.epsilon}")
    need(rl.loss_type != "cispo" or (rl.epsilon_high is not None and rl.epsilon_high >= 1), "rl.epsilon_high",
         "cispo caps the importance weight at epsilon_high itself (not at 1 + epsilon_high), so it must be at least "
         f"1; its default (epsilon) or a DAPO value would cap every weight below 1; ScaleRL uses 5.0, got "
         f"{rl.epsilon_high}")
    need(rl.delta is None or rl.loss_type != "cispo", "rl.delta",
         "caps the ratio of the clipped surrogate, which cispo does not have; remove it")
    need(rl.delta is None or rl.delta > 1, "rl.delta",
         f"a cap on the ratio, above 1 (TRL recommends above 1 + epsilon_high), got {rl.delta}")
    if rl.epsilon_high is None:
        rl.epsilon_high = rl.epsilon
    need(rl.epsilon_high > 0, "rl.epsilon_high", f"must be positive, got {rl.epsilon_high}")
    need(rl.beta >= 0, "rl.beta", f"must be 0 or more, got {rl.beta}")
    if rl.beta > 0 and not r.lora.enabled:  # full fine-tuning: a frozen copy of the base is the reference
        need(r.model.preset is None, "rl.beta",
             "above 0 with full fine-tuning the reference is a frozen copy of the base loaded from model.path; a "
             "preset has none: save it as a folder first, or set lora.enabled=true (the base is the reference)")
        need(not r.model.add_special_tokens, "model.add_special_tokens",
             "with rl.beta above 0 and full fine-tuning the reference would lack the added tokens' rows; set "
             "lora.enabled=true, or add the tokens to the base first")
    need(rl.num_iterations >= 1, "rl.num_iterations", f"must be at least 1, got {rl.num_iterations}")
    k = rl.num_iterations
    need(not r.train.max_steps or r.train.max_steps % k == 0, "train.max_steps",
         f"a multiple of rl.num_iterations={k} (a generated batch trains {k} steps), got {r.train.max_steps}")
    need(r.checkpoint.every_steps % k == 0, "checkpoint.every_steps",
         f"a multiple of rl.num_iterations={k}: a checkpoint between a generated batch's steps would not hold "
         f"the batch, got {r.checkpoint.every_steps}")
    need(rl.max_unscored_steps >= 0, "rl.max_unscored_steps", f"must be 0 (never stop) or more, got "
         f"{rl.max_unscored_steps}")
    validate_sampling(r, need)
    validate_sampler(r, need)
    need(0 < rl.top_entropy_quantile <= 1, "rl.top_entropy_quantile",
         f"the share of tokens kept, in (0, 1] (1: every token; TRL's paper keeps 0.2), got {rl.top_entropy_quantile}")
    need(bool(rl.rewards), "rl.rewards", "give at least one reward function (file.py:name, module:name or "
         + ", ".join(BUILT_IN_REWARDS) + ")")
    rl.rewards = [e if isinstance(e, RewardConfig) else RewardConfig(function=e) for e in rl.rewards]
    for i, e in enumerate(rl.rewards):
        key = f"rl.rewards[{i}]"
        need(math.isfinite(e.weight), f"{key}.weight", f"must be a finite number, got {e.weight}")
        if e.model is not None:
            need(not e.function, f"{key}.model", f"a reward model or a function ({e.function!r}), not both")
            need(e.pattern is None, f"{key}.pattern", "only the built-in regex reward takes a pattern")
            need(bool(str(e.model).strip()), f"{key}.model", "empty: give a sequence-classification model folder "
                 "or Hub id")
            continue
        need(bool(e.function), f"{key}.function", "give a function (file.py:name, module:name or a built-in) or "
             "a reward model (model: FOLDER)")
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
    validate_tools(r, need)
    validate_prompt_data(r, need)


def validate_tools(r: Recipe, need) -> None:
    """rl.tools: each named as a reward function is, its file here; the iteration limit and timeout in range.
    Importing each and reading its schema happen when the run starts, before the model loads."""
    rl = r.rl
    for i, spec in enumerate(rl.tools):
        name, sep, attr = str(spec).rpartition(":")
        need(bool(sep and name and attr.isidentifier()), f"rl.tools[{i}]",
             f"{spec!r}: give path/to/file.py:function or module:function")
        if name.endswith(".py"):
            need(Path(name).expanduser().is_file(), f"rl.tools[{i}]", f"file not found: {name}")
    need(len(set(rl.tools)) == len(rl.tools), "rl.tools", "a tool named twice")
    env = rl.environment
    entries = {"rl.environment": env} if isinstance(env, str) else {f"rl.environment.{k}": v
                                                                      for k, v in (env or {}).items()}
    need(env is None or bool(entries), "rl.environment", "an empty mapping: give FILE.py:Class, or names to them")
    for key, spec in entries.items():
        name, sep, attr = str(spec).rpartition(":")
        need(bool(sep and name and attr.isidentifier()), key, f"{spec!r}: give path/to/file.py:Class or module:Class")
        if name.endswith(".py"):
            need(Path(name).expanduser().is_file(), key, f"file not found: {name}")
    need(rl.max_tool_calling_iterations is None or rl.max_tool_calling_iterations >= 0,
         "rl.max_tool_calling_iterations", f"must be 0 or more (None: no limit), got {rl.max_tool_calling_iterations}")
    need(rl.tool_timeout is None or rl.tool_timeout > 0, "rl.tool_timeout",
         f"must be positive (None: no limit), got {rl.tool_timeout}")
    if not rl.tools and env is None:
        for name in ("max_tool_calling_iterations", "tool_timeout"):
            need(getattr(rl, name) == getattr(RLConfig(), name), f"rl.{name}",
                 "a setting of rl.tools and rl.environment; set one")


def validate_sampling(r: Recipe, need) -> None:
    """What every rl.method samples with."""
    rl = r.rl
    need(rl.max_new_tokens > 0, "rl.max_new_tokens", f"must be positive, got {rl.max_new_tokens}")
    need(rl.temperature > 0, "rl.temperature", f"must be above 0 (the completions are sampled at it), got "
         f"{rl.temperature}")
    need(0 < rl.top_p <= 1, "rl.top_p", f"must be in (0, 1], got {rl.top_p}")
    need(rl.top_k >= 0, "rl.top_k", f"must be 0 (off) or a number of tokens, got {rl.top_k}")
    need(rl.repetition_penalty > 0, "rl.repetition_penalty", f"must be above 0 (1: off), got {rl.repetition_penalty}")
    need(rl.min_p is None or 0 <= rl.min_p <= 1, "rl.min_p", f"must be in [0, 1], got {rl.min_p}")
    need(rl.num_generations_eval is None or rl.num_generations_eval >= 1, "rl.num_generations_eval",
         f"at least 1 completion per eval prompt, got {rl.num_generations_eval}")
    need(rl.num_completions_to_print is None or rl.num_completions_to_print >= 0, "rl.num_completions_to_print",
         f"a number of completions (0: none; unset: all), got {rl.num_completions_to_print}")
    need(rl.num_completions_to_print is None or rl.log_completions, "rl.num_completions_to_print",
         "shows completions of the table rl.log_completions writes; set rl.log_completions: true")


VLLM_KEYS = ("max_staleness", "vllm_url", "vllm_python", "vllm_args", "vllm_timeout",
             "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")


# Server arguments the run sets itself for the server it starts (rollout/server.py): given again, they would
# move it away from where the run looks for it or change what its answers mean.
RUN_SET_ARGS = ("--host", "--port", "--model", "--served-model-name", "--logprobs-mode", "--worker-extension-cls",
                "--uds", "--ssl-keyfile", "--ssl-certfile", "--api-key")


def validate_staleness(r: Recipe, need) -> None:
    """rl.max_staleness: batches sampled ahead on the server, whose lag the correction covers."""
    rl = r.rl
    need(rl.max_staleness >= 0, "rl.max_staleness", f"optimizer steps, 0 or more, got {rl.max_staleness}")
    if not rl.max_staleness:
        return
    need(rl.vllm_importance_sampling_correction, "rl.vllm_importance_sampling_correction",
         f"false: with rl.max_staleness {rl.max_staleness} the batches are sampled with older weights, and the "
         "correction is what covers the lag; set it true or rl.max_staleness: 0")
    need(rl.num_iterations == 1, "rl.num_iterations",
         f"{rl.num_iterations}: with rl.max_staleness each batch trains one step (as TRL's AsyncGRPOTrainer)")
    need(rl.environment is None, "rl.environment",
         "with rl.max_staleness: an environment's state is shared by the batches sampled ahead and cannot be "
         "saved in a checkpoint; set rl.max_staleness: 0")


def validate_sampler(r: Recipe, need) -> None:
    """rl.sampler and its vLLM keys: the server's settings only with it; an adapter vLLM serves;
    a model folder the server can load; the environment to start it from, or a URL."""
    rl, default = r.rl, RLConfig()
    if rl.sampler == "toolkit":
        for name in VLLM_KEYS:
            need(getattr(rl, name) == getattr(default, name), f"rl.{name}",
                 "a vLLM setting: set rl.sampler: vllm, or remove it")
        return
    need(rl.method in ("grpo", "rloo"), "rl.sampler", f"vllm: grpo and rloo only (rl.method is {rl.method}); use "
         "the toolkit's sampler")
    need(rl.method != "rloo" or not rl.vllm_importance_sampling_correction
         or rl.vllm_importance_sampling_mode.startswith("sequence"), "rl.vllm_importance_sampling_mode",
         f"rloo's loss is per completion: a sequence mode (sequence_mask, sequence_truncate), got "
         f"{rl.vllm_importance_sampling_mode}")
    if r.lora.enabled:
        need(not r.lora.use_dora, "lora.use_dora", "vLLM serves no DoRA adapter: with rl.sampler: vllm use plain LoRA")
        need(r.lora.r <= 512, "lora.r", f"vLLM serves adapters of rank up to 512, got {r.lora.r}")
    if not rl.vllm_importance_sampling_correction:
        for name in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                     "vllm_importance_sampling_clip_max"):
            need(getattr(rl, name) == getattr(default, name), f"rl.{name}",
                 "a setting of the correction, which rl.vllm_importance_sampling_correction: false turns off")
    validate_staleness(r, need)
    need(r.model.preset is None, "rl.sampler", "vllm: the server loads model.path; a preset has no folder: save it "
         "as one first")
    need(not r.model.add_special_tokens, "model.add_special_tokens",
         "with rl.sampler: vllm the server's base would lack the added tokens' rows")
    need(rl.vllm_timeout > 0, "rl.vllm_timeout", f"seconds, above 0, got {rl.vllm_timeout}")
    low, high = rl.vllm_importance_sampling_clip_min, rl.vllm_importance_sampling_clip_max
    need(low is None or low >= 0, "rl.vllm_importance_sampling_clip_min", f"a ratio, 0 or more, got {low}")
    need(high is None or high > 0, "rl.vllm_importance_sampling_clip_max", f"a ratio, above 0, got {high}")
    need(low is None or high is None or low < high, "rl.vllm_importance_sampling_clip_min",
         f"below rl.vllm_importance_sampling_clip_max ({high}), got {low}")
    if rl.vllm_url is not None:
        need(str(rl.vllm_url).startswith(("http://", "https://")), "rl.vllm_url",
             f"http://HOST:PORT of a running vLLM server, got {rl.vllm_url!r}")
        need(not rl.vllm_args and rl.vllm_python is None, "rl.vllm_args" if rl.vllm_args else "rl.vllm_python",
             "for the server the run starts; with rl.vllm_url the server is yours: remove it")
        return
    share = server_arg(rl.vllm_args, "--gpu-memory-utilization")
    if share is not None:
        try:
            ok = 0 < float(share) < 1
        except ValueError:
            ok = False
        need(ok, "rl.vllm_args", f"--gpu-memory-utilization: the share of the GPU the server takes, between 0 and 1, "
             f"got {share!r}")
    owned = next((a for a in rl.vllm_args if server_flag(a) in RUN_SET_ARGS), None)
    need(owned is None, "rl.vllm_args", f"{owned} is the run's to set (it reaches the server at 127.0.0.1 over plain "
         "HTTP without a key, asking for completions by model.path); leave it out")
    python = Path(rl.vllm_python).expanduser() if rl.vllm_python else default_vllm_python()
    need(python.is_file(), "rl.vllm_python", f"{python} not found: run `make vllm` (a virtual environment with "
         "vLLM), or give rl.vllm_url of a running server")


def validate_prompt_data(r: Recipe, need) -> None:
    """What prompt rows cannot be trained with."""
    need(not r.data.packing and not r.data.padding_free, "data.packing" if r.data.packing else "data.padding_free",
         "prompt rows are not packed: each step makes its own completions")
    need(not r.data.train_on_prompt, "data.train_on_prompt",
         "prompt rows have no targets: the sampled completions are what trains; remove the key")
    need(r.model.router_aux_loss_coef is None, "model.router_aux_loss_coef",
         "not with rl.method: the policy loss has no router term")


# What only grpo and rloo read: a distillation recipe that sets one means something the run would not do.
POLICY_GRADIENT_KEYS = ("loss_type", "importance_sampling", "epsilon", "epsilon_high", "delta", "normalize_advantages",
                        "reward_clip_range", "num_iterations", "scale_rewards", "mask_truncated_completions",
                        "rewards", "max_unscored_steps", "top_entropy_quantile", "tools",
                        "max_tool_calling_iterations", "tool_timeout", "environment")


def validate_distill(r: Recipe, need) -> None:
    """rl.method=distill: a teacher, TRL's beta in [0, 1], no reward or policy-gradient setting."""
    rl, default = r.rl, RLConfig()
    for name in POLICY_GRADIENT_KEYS:
        need(getattr(rl, name) == getattr(default, name), f"rl.{name}",
             "a grpo/rloo setting: distill's loss is the divergence to rl.teacher (no rewards, no ratio); remove it")
    need(bool(rl.teacher and str(rl.teacher).strip()), "rl.teacher",
         "rl.method=distill needs a teacher: a causal LM folder (or Hub id) with the student's vocabulary")
    if rl.beta is None:
        rl.beta = 1.0
    need(0 <= rl.beta <= 1, "rl.beta",
         f"distill: in [0, 1] (0 forward KL, 1 reverse KL, between them the generalized JSD), got {rl.beta}")
    if rl.num_generations is None:
        rl.num_generations = 1
    need(rl.num_generations >= 1, "rl.num_generations", f"at least 1, got {rl.num_generations}")
    need(rl.sampler == "toolkit", "rl.sampler", "distill samples with the student itself; vllm: grpo and rloo only")
    validate_sampler(r, need)
    validate_sampling(r, need)
    validate_prompt_data(r, need)
