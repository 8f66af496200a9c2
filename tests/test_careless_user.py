"""A careless user of the newer parts: online RL (rl.method, data.format=prompt, reward functions),
preference training, sequence parallelism, long context (RoPE scaling, tiled MLP, activation
offload), added tokens, mixture-of-experts models, QLoRA, `toolkit checkpoint convert` and
`toolkit estimate`. Odd values (0, negative, huge, a word for a number), missing files, a file of
the wrong format, contradicting settings, a resume with a changed recipe: each ends in one line
`error: ...` naming the file, key, row or function, exit 2, no traceback, nothing on disk changed.

Most cases run in this process: the CLI's `main()` with a recipe refused when it loads (before
any model), and the data and reward stages `toolkit train` runs before its model loads
(`check_data`, `setup_rewards`, `build_datasets`). Four cases are launched: a reward column missing
in a later row (the run stops at the step that meets it, its earlier checkpoints intact), a resume
of that run with another rl.num_generations, a reward file with a syntax error and a completion
longer than the model's positions (refused once the model is built, no run folder left).
"""

import hashlib
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
import yaml

from toolkit.cli import main
from toolkit.config import load_recipe
from toolkit.errors import ToolkitError

from helpers import ROOT, finish, run_toolkit, start, user_error_line, write_jsonl, write_recipe

SP_CONFIG = next((ROOT / "accelerate_configs").glob("*_sp.yaml"))  # the shipped sequence-parallel launch


def snapshot(root):
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def prompt_rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def pair_rows(n: int) -> list[dict]:
    return [{"prompt": f"Say {i}.", "chosen": str(i), "rejected": str(i + 1)} for i in range(n)]


def unpaired_rows(n: int) -> list[dict]:
    return [{"prompt": f"Say {i}.", "completion": str(i + i % 2), "label": i % 2 == 0} for i in range(n)]


def alpaca(n: int) -> list[dict]:
    return [{"instruction": "Reverse", "input": "ab" * (i + 1), "output": "ba" * (i + 1)} for i in range(n)]


BASES = {  # each careless case starts from one of these, written into its own folder
    "rl": lambda d: {"data": {"train_files": [str(write_jsonl(d / "prompts.jsonl", prompt_rows(16)))],
                              "format": "prompt", "max_seq_len": 64, "num_proc": 1},
                     "rl": {"method": "grpo", "num_generations": 4, "max_new_tokens": 8, "rewards": ["exact_match"]}},
    "pref": lambda d: {"data": {"train_files": [str(write_jsonl(d / "pairs.jsonl", pair_rows(16)))],
                                "format": "preference", "max_seq_len": 64, "num_proc": 1},
                       "preference": {"method": "dpo"}},
    "kto": lambda d: {"data": {"train_files": [str(write_jsonl(d / "rows.jsonl", unpaired_rows(16)))],
                               "format": "unpaired", "max_seq_len": 64, "num_proc": 1},
                      "preference": {"method": "kto"}},
    "sft": lambda d: {"data": {"train_files": [str(write_jsonl(d / "train.jsonl", alpaca(16)))], "format": "alpaca",
                               "max_seq_len": 64, "num_proc": 1}},
}


def recipe(d, base: str, **sections) -> Path:
    r = {"output_dir": str(d / "run"), "seed": 3, "model": {"preset": "tiny-llama-mini"},
         "train": {"micro_batch_size": 2, "max_steps": 4}, **BASES[base](d), **sections}
    return write_recipe(d / "run.yaml", **r)


@pytest.fixture
def cli(capsys):
    """`toolkit ARGS` in this process: (exit code, stdout, stderr). `train` installs its signal
    handlers (and a wakeup descriptor) first; they are put back as they were afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)

    def call(*argv):
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield call
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    signal.set_wakeup_fd(wakeup)


def one_line(code: int, err: str) -> str:
    """The refusal's line: exit 2, no traceback, one `error: ` line and it is the last."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    return errors[0]


# --------------------------------------------------------------------- recipes refused when they load
# (id, base, overrides, what the one line says). `fixed`: accepted (or refused only once the model was
# built, or under another key) before issue 44.
RL = [
    ("one generation", ["rl.num_generations=1"], "rl.num_generations: at least 2 (advantages compare"),
    ("generations as a word", ["rl.num_generations=eight"], "rl.num_generations: expected an integer, got string"),
    ("temperature 0", ["rl.temperature=0"], "rl.temperature: must be above 0 (the completions are sampled at it)"),
    ("temperature as a word", ["rl.temperature=hot"], "rl.temperature: expected a number, got string 'hot'"),
    ("top_p 0", ["rl.top_p=0"], "rl.top_p: must be in (0, 1], got 0.0"),
    ("negative top_k", ["rl.top_k=-1"], "rl.top_k: must be 0 (off) or a number of tokens, got -1"),
    ("top_k as a fraction", ["rl.top_k=0.5"], "rl.top_k: expected an integer"),
    ("repetition_penalty 0", ["rl.repetition_penalty=0"], "rl.repetition_penalty: must be above 0 (1: off), got 0"),
    ("negative max_unscored_steps", ["rl.max_unscored_steps=-1"],
     "rl.max_unscored_steps: must be 0 (never stop) or more, got -1"),
    ("min_p above 1", ["rl.min_p=2"], "rl.min_p: must be in [0, 1], got 2.0"),
    ("mask_truncated_completions as a word", ["rl.mask_truncated_completions=maybe"],
     "rl.mask_truncated_completions: expected"),
    ("negative max_new_tokens", ["rl.max_new_tokens=-1"], "rl.max_new_tokens: must be positive, got -1"),
    ("beta with full fine-tuning of a preset", ["rl.beta=0.04"],
     "rl.beta: above 0 with full fine-tuning the reference is a frozen copy of the base loaded from model.path; a "
     "preset has none"),
    ("negative beta", ["rl.beta=-0.1", "lora.enabled=true"], "rl.beta: must be 0 or more, got -0.1"),
    ("num_iterations 0", ["rl.num_iterations=0"], "rl.num_iterations: must be at least 1, got 0"),
    ("checkpoints inside a generated batch", ["rl.num_iterations=2", "checkpoint.every_steps=3"],
     "checkpoint.every_steps: a multiple of rl.num_iterations=2"),
    ("max_steps inside a generated batch", ["rl.num_iterations=2", "train.max_steps=5"],
     "train.max_steps: a multiple of rl.num_iterations=2"),
    ("fixed: rl and preference.method", ["preference.method=dpo"],
     "preference.method: one objective per run: preference.method=dpo and rl.method=grpo contradict"),
    ("fixed: a preference key under rl", ["preference.beta=0.1"],
     "preference.beta: set only with preference.method"),
    ("fixed: train_on_prompt under rl", ["data.train_on_prompt=true"],
     "data.train_on_prompt: prompt rows have no targets"),
    ("no reward", ["rl.rewards=[]"], "rl.rewards: give at least one reward function"),
    ("regex without a pattern", ["rl.rewards=[{function: regex}]"], "rl.rewards[0].pattern: the regex reward needs"),
    ("a pattern that is no regex", ["rl.rewards=[{function: regex, pattern: '('}]"],
     "rl.rewards[0].pattern: not a regular expression"),
    ("fixed: a pattern on exact_match", ["rl.rewards=[{function: exact_match, pattern: 'Answer'}]"],
     "rl.rewards[0].pattern: only the built-in regex reward takes a pattern"),
    ("fixed: an empty answer column", ["rl.rewards=[{function: numeric_match, column: ''}]"],
     "rl.rewards[0].column: empty: numeric_match needs the name of the column"),
    ("fixed: every weight 0", ["rl.rewards=[{function: exact_match, weight: 0}, {function: numeric_match, weight: 0}]"],
     "rl.rewards: every weight is 0"),
    ("a weight that is no number", ["rl.rewards=[{function: exact_match, weight: .nan}]"],
     "rl.rewards[0].weight: must be a finite number, got nan"),
    ("a reward file that is missing", ["rl.rewards=[nowhere.py:score]"],
     "rl.rewards[0].function: file not found: nowhere.py"),
    ("a reward without a function", ["rl.rewards=[score]"], "rl.rewards[0].function: 'score': give path/to/file.py"),
    ("rl on alpaca rows", ["data.format=alpaca"], "data.format: rl.method=grpo samples completions for prompts"),
    ("rl on a preference entry", ["data.train_files=[{path: pairs.jsonl, format: preference}]"],
     "data.format: rl.method=grpo samples completions for prompts: data.format (and every entry's format) must be "
     "prompt, got preference, prompt"),
    ("packed prompts", ["data.packing=true"], "data.packing: prompt rows are not packed"),
    ("padding-free prompts", ["data.padding_free=true"], "data.padding_free: prompt rows are not packed"),
    ("a router loss under rl", ["model.router_aux_loss_coef=0.01"], "model.router_aux_loss_coef: not with rl.method"),
    ("rl off, prompt rows on", ["rl.method=null"], "data.format: prompt rows train only with rl.method"),
    ("cispo on the default cap", ["rl.loss_type=cispo"],
     "rl.epsilon_high: cispo caps the importance weight at epsilon_high itself"),
    ("cispo on DAPO's clip-higher", ["rl.loss_type=cispo", "rl.epsilon_high=0.28"],
     "so it must be at least 1; its default (epsilon) or a DAPO value would cap every weight below 1; ScaleRL uses "
     "5.0, got 0.28"),
    ("delta with cispo", ["rl.loss_type=cispo", "rl.epsilon_high=5", "rl.delta=2"],
     "rl.delta: caps the ratio of the clipped surrogate, which cispo does not have"),
    ("delta taken for epsilon", ["rl.delta=0.2"], "rl.delta: a cap on the ratio, above 1"),
    ("a TRL loss type not built", ["rl.loss_type=bnpo"], "rl.loss_type: must be one of grpo, dapo, dr_grpo, cispo"),
    ("top entropy share as a percent", ["rl.top_entropy_quantile=20"],
     "rl.top_entropy_quantile: the share of tokens kept, in (0, 1] (1: every token; TRL's paper keeps 0.2), got 20"),
    ("no top entropy tokens", ["rl.top_entropy_quantile=0"], "rl.top_entropy_quantile: the share of tokens kept"),
    ("a GRPO loss type under rloo", ["rl.method=rloo", "rl.loss_type=grpo"],
     "rl.loss_type: a GRPO setting: rloo's loss is TRL's RLOO (one ratio per completion, leave-one-out advantages)"),
    ("an RLOO key under grpo", ["rl.normalize_advantages=true"],
     "rl.normalize_advantages: an RLOO setting (rl.method=rloo)"),
    ("a reward clip range upside down", ["rl.method=rloo", "rl.reward_clip_range=[1, 0]"],
     "rl.reward_clip_range: [low, high] with low below high, got [1.0, 0.0]"),
    ("no eval completions", ["rl.num_generations_eval=0"],
     "rl.num_generations_eval: at least 1 completion per eval prompt, got 0"),
    ("completions printed without the table", ["rl.num_completions_to_print=3"],
     "rl.num_completions_to_print: shows completions of the table rl.log_completions writes; set "
     "rl.log_completions: true"),
    ("a negative number printed", ["rl.log_completions=true", "rl.num_completions_to_print=-1"],
     "rl.num_completions_to_print: a number of completions (0: none; unset: all), got -1"),
    ("gathering as a word", ["rl.gather_for_sampling=sometimes"],
     "rl.gather_for_sampling: expected"),
    ("a vLLM key without the vLLM sampler", ["rl.vllm_url=http://127.0.0.1:8000"],
     "rl.vllm_url: a vLLM setting: set rl.sampler: vllm, or remove it"),
    ("vLLM on a preset", ["rl.sampler=vllm", "lora.enabled=true"],
     "rl.sampler: vllm: the server loads model.path; a preset has no folder"),
    ("vLLM in capitals", ["rl.sampler=vLLM"], "rl.sampler: must be one of toolkit, vllm"),
]
PREFERENCE = [
    ("beta 0", ["preference.beta=0"], "preference.beta: must be positive, got 0.0"),
    ("beta as a word", ["preference.beta=strong"], "preference.beta: expected a number, got string 'strong'"),
    ("method in capitals", ["preference.method=DPO"],
     "preference.method: must be one of dpo, orpo, simpo, kto, reward; got 'DPO'"),
    ("adapter reference without LoRA", ["preference.reference=adapter"],
     "preference.reference: adapter: the reference is the model with its LoRA adapter disabled"),
    ("a SimPO key on DPO", ["preference.gamma=0.5"], "preference.gamma: a SimPO setting, not dpo's"),
    ("label smoothing 0.5", ["preference.label_smoothing=0.5"], "preference.label_smoothing: must be in [0, 0.5)"),
    ("packed pairs", ["data.packing=true"], "data.packing: preference pairs are not packed"),
    ("pairs as prompts", ["data.format=prompt"], "data.format: preference.method=dpo trains on pairs"),
    ("pairs without a method", ["preference.method=null"], "data.format: preference pairs train only with a"),
    ("rl keys on preference", ["rl.num_generations=4"],
     "rl.num_generations: set only with rl.method (grpo, rloo or distill)"),
    ("kto on pairs", ["preference.method=kto"], "data.format: preference.method=kto trains on unpaired rows (prompt, "
     "completion, label): data.format (and every entry's format) must be unpaired, got preference (write each pair as "
     "two rows: prompt and chosen with label true, prompt and rejected with label false)"),
    ("a KTO weight on DPO", ["preference.desirable_weight=2"], "preference.desirable_weight: a KTO setting, not dpo's"),
    ("a KTO loss type on DPO", ["preference.loss_type=kto"],
     "preference.loss_type: preference.method=dpo takes sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, "
     "sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft or sigmoid_norm, got kto"),
    ("a reward model with a beta", ["preference.method=reward", "preference.beta=0.1"],
     "preference.beta: not a reward-model setting: a reward model has no policy, reference or β; remove it"),
    ("a reward model padding-free", ["preference.method=reward", "data.padding_free=true"],
     "data.padding_free: a reward model reads its score at each sequence's last token"),
    ("a reward model asked for samples", ["preference.method=reward", "train.sample_prompts=[hi]"],
     "train.sample_prompts: a reward model does not generate; remove it"),
    ("a negative centring", ["preference.method=reward", "preference.center_rewards_coefficient=-0.01"],
     "preference.center_rewards_coefficient: must be 0 or more, got -0.01"),
    ("a LoRA reward model", ["preference.method=reward", "lora.enabled=true"],
     "lora.enabled: a reward model trains fully for now"),
    ("centring on DPO", ["preference.center_rewards_coefficient=0.01"],
     "preference.center_rewards_coefficient: a reward-model setting (preference.method=reward), not dpo's"),
]
KTO = [
    ("a weight of 0", ["preference.desirable_weight=0"],
     "preference.desirable_weight: must be a positive number, got 0.0"),
    ("a negative weight", ["preference.undesirable_weight=-1"],
     "preference.undesirable_weight: must be a positive number, got -1.0"),
    ("a DPO loss type on KTO", ["preference.loss_type=ipo"],
     "preference.loss_type: preference.method=kto takes kto or apo_zero_unpaired, got ipo"),
    ("DPO on unpaired rows", ["preference.method=dpo"],
     "data.format: preference.method=dpo trains on pairs: data.format "
     "(and every entry's format) must be preference, got unpaired"),
    ("a reward model on unpaired rows", ["preference.method=reward"],
     "data.format: preference.method=reward trains on pairs: data.format (and every entry's format) must be "
     "preference, got unpaired"),
    ("unpaired rows without a method", ["preference.method=null"],
     "data.format: unpaired rows train only with preference.method=kto"),
    ("label smoothing on KTO", ["preference.label_smoothing=0.1"],
     "preference.label_smoothing: applies to dpo with loss_type sigmoid, robust, exo_pair, aot or aot_unpaired and "
     "to simpo only"),
    ("a reference on KTO with full fine-tuning", ["preference.reference=adapter"],
     "preference.reference: adapter: the reference is the model with its LoRA adapter disabled"),
]
LONG_CONTEXT = [
    ("fixed: a RoPE factor below 1", ["model.rope_scaling={rope_type: linear, factor: 0.5}"],
     "model.rope_scaling.factor: must be at least 1 (how many times longer the context becomes), got 0.5"),
    ("fixed: yarn without its original context", ["model.rope_scaling={rope_type: yarn, factor: 4}"],
     "model.rope_scaling.original_max_position_embeddings: required for rope_type yarn"),
    ("fixed: yarn's betas swapped",
     ["model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 64, beta_fast: 1, "
      "beta_slow: 32}"], "model.rope_scaling.beta_fast: must be above beta_slow"),
    ("fixed: a negative attention factor",
     ["model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 64, attention_factor: -1}"],
     "model.rope_scaling.attention_factor: must be positive, got -1.0"),
    ("fixed: llama3's frequencies swapped",
     ["model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1, "
      "original_max_position_embeddings: 64}"], "model.rope_scaling.low_freq_factor: must be below high_freq_factor"),
    ("a negative RoPE factor", ["model.rope_scaling={rope_type: yarn, factor: -2}"],
     "model.rope_scaling.factor: must be positive"),
    ("RoPE scaling as a word", ["model.rope_scaling=yarn"], "model.rope_scaling: expected a section (mapping)"),
    ("a RoPE type unknown", ["model.rope_scaling={rope_type: ntk, factor: 2}"],
     "model.rope_scaling.rope_type: must be one of linear, dynamic, yarn, llama3; got 'ntk'"),
    ("positions fewer than max_seq_len", ["model.max_position_embeddings=32"],
     "model.max_position_embeddings: 32 is shorter than data.max_seq_len=64"),
    ("positions as 4k", ["model.max_position_embeddings=4k"], "model.max_position_embeddings: expected an integer"),
    ("offload without checkpointing", ["model.activation_offload=true"],
     "model.activation_offload: offloads the activations that gradient checkpointing keeps"),
    ("offload as a word", ["model.activation_offload=maybe"], "model.activation_offload: expected true/false"),
]
TOKENS_MOE_QLORA = [
    ("an input resume cannot accept changed", ["resume_accept_changed=[data]"],
     "resume_accept_changed: each must be one of model, rewards, reward_models, teacher, tools, got ['data']"),
    ("an empty added token", ['model.add_special_tokens=[""]'], "model.add_special_tokens: each token must be"),
    ("a blank added token", ['model.add_special_tokens=["<tool>", " "]'], "model.add_special_tokens: each token must"),
    ("a number as added token", ["model.add_special_tokens=[3]"],
     "model.add_special_tokens[0]: expected a string, got integer 3"),
    ("added tokens null", ["model.add_special_tokens=null"], "model.add_special_tokens: expected a list, got nothing"),
    ("a negative router loss", ["model.router_aux_loss_coef=-1"], "model.router_aux_loss_coef: must be 0 or more"),
    ("a router loss as a word", ["model.router_aux_loss_coef=high"], "model.router_aux_loss_coef: expected a number"),
    ("4-bit without LoRA", ["model.load_in_4bit=true"], "model.load_in_4bit: a 4-bit base cannot be trained itself"),
    ("4-bit over a preset", ["model.load_in_4bit=true", "lora.enabled=true"],
     "model.load_in_4bit: QLoRA quantizes a model.path base while loading it"),
    ("4-bit as 1", ["model.load_in_4bit=1"], "model.load_in_4bit: expected true/false, got integer 1"),
    ("4-bit base in bf16 computed in fp32", ["model.load_in_4bit=true", "lora.enabled=true", "model.dtype=bf16"],
     "model.dtype: bf16 base weights need train.precision=bf16, got fp32"),
]
CASES = ([("rl", *c) for c in RL] + [("pref", *c) for c in PREFERENCE] + [("kto", *c) for c in KTO]
         + [("sft", *c) for c in LONG_CONTEXT]
         + [("sft", *c) for c in TOKENS_MOE_QLORA])


@pytest.mark.parametrize("base, case, overrides, expected", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_a_careless_recipe_is_refused_in_one_line(tmp_path, cli, monkeypatch, base, case, overrides, expected):
    monkeypatch.chdir(tmp_path)  # relative paths (a reward file, a data entry) as a user in this folder writes them
    path = recipe(tmp_path, base)
    write_jsonl(tmp_path / "pairs.jsonl", pair_rows(4))
    before = snapshot(tmp_path)
    line = one_line(*cli("train", path, *overrides)[::2])
    # a mistake at a key an override set is the command line's (issue 53), any other the recipe file's
    source = next((f"command line ({o})" for o in overrides if f" {o.partition('=')[0]}: " in line), str(path))
    assert line.startswith(f"error: {source}: ") and expected in line, line
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


VLLM = [  # (id, overrides on a LoRA GRPO recipe of a model folder with rl.sampler vllm, what the line says)
    ("a URL without its scheme", ["rl.vllm_url=127.0.0.1:8000"],
     "rl.vllm_url: http://HOST:PORT of a running vLLM server, got '127.0.0.1:8000'"),
    ("server arguments for a server at a URL", ["rl.vllm_url=http://127.0.0.1:8000", "rl.vllm_args=[--seed, '1']"],
     "rl.vllm_args: for the server the run starts; with rl.vllm_url the server is yours"),
    ("no vLLM environment", ["rl.vllm_python=/nowhere/bin/python"],
     "rl.vllm_python: /nowhere/bin/python not found: run `make vllm`"),
    ("bounds upside down", ["rl.vllm_url=http://127.0.0.1:8000", "rl.vllm_importance_sampling_clip_min=4"],
     "rl.vllm_importance_sampling_clip_min: below rl.vllm_importance_sampling_clip_max (3.0), got 4.0"),
    ("a mode with the correction off", ["rl.vllm_url=http://127.0.0.1:8000",
                                        "rl.vllm_importance_sampling_correction=false",
                                        "rl.vllm_importance_sampling_mode=token_mask"],
     "rl.vllm_importance_sampling_mode: a setting of the correction, which rl.vllm_importance_sampling_correction"),
    ("DoRA", ["rl.vllm_url=http://127.0.0.1:8000", "lora.use_dora=true"], "lora.use_dora: vLLM serves no DoRA"),
    ("a rank vLLM cannot serve", ["rl.vllm_url=http://127.0.0.1:8000", "lora.r=1024"],
     "lora.r: vLLM serves adapters of rank up to 512, got 1024"),
    ("a token mode under rloo", ["rl.vllm_url=http://127.0.0.1:8000", "rl.method=rloo",
                                 "rl.vllm_importance_sampling_mode=token_truncate"],
     "rl.vllm_importance_sampling_mode: rloo's loss is per completion: a sequence mode"),
    ("a port for the server the run starts", ["rl.vllm_args=[--port, '8000']"],
     "rl.vllm_args: --port is the run's to set"),
    ("a served model name", ["rl.vllm_args=['--served_model_name=policy']"],
     "rl.vllm_args: --served_model_name=policy is the run's to set"),
    ("a GPU share above 1", ["rl.vllm_args=[--gpu-memory-utilization, '3']"],
     "rl.vllm_args: --gpu-memory-utilization: the share of the GPU the server takes, between 0 and 1, got '3'"),
    ("a GPU share by vLLM's other name", ["rl.vllm_args=['--device-memory-utilization=2']"],
     "rl.vllm_args: --gpu-memory-utilization: the share of the GPU the server takes, between 0 and 1, got '2'"),
    ("an API key for the server the run starts", ["rl.vllm_args=[--api-key, secret]"],
     "rl.vllm_args: --api-key is the run's to set"),
    ("a timeout of 0", ["rl.vllm_url=http://127.0.0.1:8000", "rl.vllm_timeout=0"], "rl.vllm_timeout: seconds, above 0"),
]


@pytest.mark.parametrize("case, overrides, expected", VLLM, ids=[c[0] for c in VLLM])
def test_a_careless_vllm_setting_is_refused_in_one_line(tmp_path, cli, case, overrides, expected):
    """rl.sampler: vllm's keys, on a LoRA recipe of a model folder (the server loads it): one line each, before any
    model loads, nothing written."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                ).save_pretrained(tmp_path / "model")
    path = recipe(tmp_path, "rl", model={"path": str(tmp_path / "model")}, lora={"enabled": True})
    before = snapshot(tmp_path)
    line = one_line(*cli("train", path, "rl.sampler=vllm", *overrides)[::2])
    assert expected in line, line
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


# --------------------------------------------------------------------- the planning verbs say what the launch says


def mixture_of_experts(d):
    """A mixture-of-experts model folder as `estimate` reads it (its config)."""
    (d / "moe").mkdir()
    (d / "moe" / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 1024}))
    return d / "moe"


PLANNING = [  # (id, argv after the verb, what the line says)
    ("estimate: one generation", lambda d: ["estimate", "--recipe", recipe(d, "rl"), "rl.num_generations=1"],
     "rl.num_generations: at least 2"),
    ("fixed: estimate: a completion past the model's positions",
     lambda d: ["estimate", "--recipe", recipe(d, "rl"), "rl.max_new_tokens=100000000"],
     "rl.max_new_tokens: a prompt of up to data.max_seq_len=64 tokens and a completion of up to "
     "rl.max_new_tokens=100000000 make 100,000,064 positions, more than the model's max_position_embeddings=1024"),
    ("estimate: rl split across GPUs", lambda d: ["estimate", "--recipe", recipe(d, "rl"), "--sp-size", "2",
                                                  "--gpus", "2"], "--sp-size is 2: online RL"),
    ("estimate: rl under a sequence-parallel launch",
     lambda d: ["estimate", "--recipe", recipe(d, "rl"), "--config_file", SP_CONFIG],
     "parallelism_config_sp_size is 2: online RL (rl.method"),
    ("fixed: config show: rl under a sequence-parallel launch",
     lambda d: ["config", "show", recipe(d, "rl"), "--accelerate-config", SP_CONFIG],
     "parallelism_config_sp_size is 2: online RL (rl.method=grpo) samples and scores whole completions"),
    ("config show: preference under a sequence-parallel launch",
     lambda d: ["config", "show", recipe(d, "pref"), "--accelerate-config", SP_CONFIG],
     "sequence parallelism does not run preference training (preference.method=dpo)"),
    ("config show: 3 processes in pairs",
     lambda d: ["config", "show", recipe(d, "sft"), "--accelerate-config", SP_CONFIG, "--num-processes", "3"],
     "parallelism_config_sp_size is 2 but a launch of 3 process(es) does not divide into groups of 2"),
    ("fixed: estimate: a tiled MLP on a mixture of experts",
     lambda d: ["estimate", "--recipe", recipe(d, "sft", model={"path": str(mixture_of_experts(d)), "tiled_mlp": True,
                                                                "gradient_checkpointing": True})],
     "model.tiled_mlp: for dense models; this one's MLPs are mixture-of-experts layers"),
    ("fixed: estimate --tiled-mlp on a mixture of experts",
     lambda d: ["estimate", "--model", mixture_of_experts(d), "--tiled-mlp", "--gradient-checkpointing"],
     "model.tiled_mlp: for dense models"),
    ("estimate: 4-bit on a preset", lambda d: ["estimate", "--model", "tiny-llama-mini", "--load-in-4bit"],
     "--load-in-4bit: tiny-llama-mini is a preset"),
    ("estimate: micro-batch 0", lambda d: ["estimate", "--recipe", recipe(d, "rl"), "--micro-batch", "0"],
     "--micro-batch: must be at least 1, got 0"),
    ("estimate: a recipe that is missing", lambda d: ["estimate", "--recipe", d / "nowhere.yaml"],
     "nowhere.yaml: recipe file not found"),
    ("estimate: a data file as the recipe",
     lambda d: ["estimate", "--recipe", write_jsonl(d / "prompts.jsonl", prompt_rows(4))], "invalid YAML"),
    ("estimate: a model folder without a config", lambda d: ["estimate", "--model", d], "has no config.json"),
]


@pytest.mark.parametrize("case, argv, expected", PLANNING, ids=[c[0] for c in PLANNING])
def test_the_planning_verbs_refuse_what_the_launch_refuses(tmp_path, cli, monkeypatch, case, argv, expected):
    monkeypatch.chdir(ROOT)  # the shipped launch configs name their DeepSpeed JSONs from the checkout's root
    args = argv(tmp_path)
    before = snapshot(tmp_path)
    line = one_line(*cli(*args)[::2])
    assert expected in line, line
    assert snapshot(tmp_path) == before


def test_config_without_show_and_with_the_launchers_flag_name_do_what_was_meant(tmp_path, cli, monkeypatch):
    """Issue 53: `toolkit config RECIPE` (the one action left out) shows the recipe; `--config_file`, the flag
    `accelerate launch` and `toolkit estimate` use for the same file, works as --accelerate-config."""
    monkeypatch.chdir(ROOT)
    path = recipe(tmp_path, "sft")
    code, out, err = cli("config", path)
    assert code == 0 and "output_dir:" in out, err
    code, plain, err = cli("config", "show", path, "--accelerate-config", ROOT / "accelerate_configs" / "ddp.yaml")
    assert code == 0, err
    code, same, err = cli("config", path, "--config_file", ROOT / "accelerate_configs" / "ddp.yaml")
    assert code == 0 and same == plain and "accelerate_configs/ddp.yaml: ddp, 8 process(es)" in same, err


# --------------------------------------------------------------------- checkpoint convert of what is no checkpoint


def not_a_checkpoint(d):
    (d / "weights").mkdir()
    (d / "weights" / "model.safetensors").write_text("not weights")
    return d / "weights"


def run_folder_without_checkpoints(d):
    (d / "run").mkdir()
    (d / "run" / "config.yaml").write_text(yaml.safe_dump({"output_dir": str(d / "run")}))
    (d / "run" / "metrics.jsonl").write_text("")
    return d / "run"


CONVERT = [
    ("a folder of weights", not_a_checkpoint, "is not a complete checkpoint (no COMPLETE marker)"),
    ("fixed: a run folder", run_folder_without_checkpoints,
     "is a run folder, not a checkpoint; give one of its checkpoints (it has no complete one)"),
    ("a folder that is missing", lambda d: d / "gone", "gone: folder not found"),
    ("fixed: a file", lambda d: write_jsonl(d / "x.jsonl", [{}]), "x.jsonl: a file, not a checkpoint folder"),
]


@pytest.mark.parametrize("case, source, expected", CONVERT, ids=[c[0] for c in CONVERT])
def test_convert_of_what_is_no_checkpoint_is_refused_in_one_line(tmp_path, cli, case, source, expected):
    given = source(tmp_path)
    before = snapshot(tmp_path)
    line = one_line(*cli("checkpoint", "convert", given, "--out", tmp_path / "hf")[::2])
    assert line.startswith("error: checkpoint convert: ") and expected in line, line
    assert snapshot(tmp_path) == before and not (tmp_path / "hf").exists()


def test_convert_never_writes_into_a_folder_that_holds_something(tmp_path, cli):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    line = one_line(*cli("checkpoint", "convert", not_a_checkpoint(tmp_path), "--out", tmp_path / "hf")[::2])
    assert "--out" in line and "exists and is not empty" in line, line
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith("hf")} == \
        {k: v for k, v in before.items() if k.startswith("hf")}


# --------------------------------------------------------------------- data and reward functions, before the model


@pytest.fixture
def stages(tmp_path, monkeypatch):
    """The stages `toolkit train` runs before its model loads, on a prompt recipe whose data and
    rewards the test gives: data.train_files, rl.rewards (relative to tmp_path) and the prepared data
    (in tmp_path/cache). Returns a function that raises what the run would stop with, or returns the
    prepared data."""
    import datasets

    from toolkit.data.prepare import build_datasets
    from toolkit.model.load import build_tokenizer
    from toolkit.training.build import check_data, setup_rewards

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = recipe(tmp_path, "rl")

    def run(data_file, *overrides, format="prompt"):
        r = load_recipe(path, [f"data.train_files=[{data_file}]", f"data.format={format}", *overrides])
        check_data(r)
        setup_rewards(r)
        return build_datasets(r.data, build_tokenizer(r.model), r.seed, False)
    return run


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(ToolkitError) as e:
        call(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_a_prompt_file_given_as_pairs_is_refused_naming_the_file_and_columns(tmp_path, stages):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(16))
    message = refusal(stages, prompts, "rl.method=null", "preference.method=dpo", "rl.rewards=[]",
                      "rl.num_generations=8", "rl.max_new_tokens=256", format="preference")
    assert "prompts.jsonl" in message and "chosen, rejected" in message, message


def test_a_pair_file_given_as_prompts_is_refused_by_the_reward_that_looks_for_its_answer(tmp_path, stages):
    """The pairs have a `prompt` column, so they read as prompts (their other columns go to the
    rewards, as in TRL); exact_match finds no `answer` in the first row and says so before training."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows(16))
    message = refusal(stages, pairs)
    assert message.startswith(f"{pairs} row 1: reward exact_match at step 0: the row has no 'answer' column"), message


@pytest.mark.parametrize("source, function, expected", [
    ("def score(completions, **kwargs)\n    return [0.0 for c in completions]\n", "bad.py:score",
     "rl.rewards[0].function: 'bad.py:score': importing bad.py: raised SyntaxError: expected ':' (bad.py, line 1)"),
    ("def score(completions, **kwargs):\n    return ['good' for c in completions]\n", "bad.py:score",
     "row 1: reward bad.py:score at step 0: returned 'good' (str) for completion 0; return a real number or None"),
    ("def score(completions):\n    return [1.0 for c in completions]\n", "bad.py:score",
     "cannot take the keywords TRL passes"),
    ("score = 1.0\n", "bad.py:score", "score is a float, not a function"),
], ids=["a syntax error", "strings returned", "no **kwargs", "not a function"])
def test_a_reward_function_that_cannot_score_is_refused_before_the_model_loads(tmp_path, stages, source, function,
                                                                               expected):
    (tmp_path / "bad.py").write_text(source)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(16))
    assert expected in refusal(stages, prompts, f"rl.rewards=[{function}]")


def test_an_empty_prompt_is_refused_by_row_not_sampled_from_a_bos_alone(tmp_path, stages):
    """Before issue 44 a prompt of "" (or spaces) trained: completions were sampled after BOS alone."""
    for i, empty in enumerate(("", "   ")):
        rows = prompt_rows(16)
        rows[5]["prompt"] = empty
        message = refusal(stages, write_jsonl(tmp_path / f"empty{i}.jsonl", rows))
        assert f"empty{i}.jsonl: row 6: no target tokens left (prompt is empty)" in message, message


def test_a_chat_prompt_without_content_is_refused_by_row(tmp_path, stages):
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in prompt_rows(16)]
    rows[3]["prompt"] = [{"role": "user"}]
    message = refusal(stages, write_jsonl(tmp_path / "chat.jsonl", rows))
    assert "chat.jsonl: row 4: prompt[0] is not a chat message with text `role` and `content`" in message, message


def test_an_overlong_prompt_is_dropped_and_counted_truthfully(tmp_path, stages):
    """A 3000-token prompt is dropped, never cut, and the data lines count it; a prompt has no
    targets, so none are said lost (before issue 44: "(1 target tokens lost)")."""
    rows = prompt_rows(16)
    rows[5]["prompt"] = "x" * 3000
    data = stages(write_jsonl(tmp_path / "long.jsonl", rows))
    assert len(data.train) == 15
    assert "1 of 16 rows longer than data.max_seq_len dropped" in data.lines, data.lines
    assert not any("target tokens lost" in line for line in data.lines), data.lines


def test_prompts_that_are_all_overlong_are_refused_naming_max_seq_len(tmp_path, stages):
    """Before issue 44 the line blamed data.overlong=drop, which the user never set."""
    message = refusal(stages, write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 3000, "answer": "1"}] * 16))
    assert message == (f"{tmp_path / 'long.jsonl'}: no rows left after dropping the 16 rows longer than "
                       "data.max_seq_len=64 (prompts longer than data.max_seq_len are dropped, never cut); raise "
                       "data.max_seq_len"), message


# --------------------------------------------------------------------- launched: a run that meets a bad row, its resume


def rl_sections(d, name, **rl):
    return {"output_dir": str(d / name), "seed": 3, "model": {"preset": "tiny-llama-mini"}, "lora": {"enabled": False},
            "data": {"train_files": [str(d / "train.jsonl")], "format": "prompt", "max_seq_len": 64, "num_proc": 1},
            "rl": {"method": "grpo", "num_generations": 2, "max_new_tokens": 4, "rewards": ["exact_match"], **rl},
            "train": {"micro_batch_size": 2, "max_steps": 4, "learning_rate": 1e-3, "log_every_steps": 1},
            "checkpoint": {"every_steps": 1, "keep_last": 10}}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """An RL run whose rows all have `answer` but one that a later step samples (the check before
    training reads the first rows only): it stops at that step in one line; (run folder, the bad
    row, the step that met it, the process)."""
    d = tmp_path_factory.mktemp("careless_rl")
    order = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()  # the sampler's first epoch
    at = next(i for i in range(2, 8) if order[i] not in (0, 1))  # after step 1, not a row the early check reads
    rows = prompt_rows(8)
    del rows[order[at]]["answer"]
    write_jsonl(d / "train.jsonl", rows)
    proc = run_toolkit("train", write_recipe(d / "rl.yaml", **rl_sections(d, "rl")), timeout=300)
    return d, order[at] + 1, at // 2 + 1, proc


@pytest.mark.launch
def test_a_reward_column_missing_in_a_later_row_stops_at_that_step_with_the_checkpoints_before_it(stopped_run):
    d, row, step, proc = stopped_run
    line = user_error_line(proc)
    assert line == (f"error: {d / 'train.jsonl'} row {row}: reward exact_match at step {step}: the row has no 'answer' "
                    "column; give it one, or name the answer's column in the reward's `column` key"), line
    kept = sorted(p.name for p in (d / "rl" / "checkpoints").iterdir())
    assert kept == [f"step-{s:06d}" for s in range(1, step)], kept
    assert all((d / "rl" / "checkpoints" / k / "COMPLETE").is_file() for k in kept)


@pytest.mark.launch
def test_resuming_with_another_num_generations_is_refused_and_the_run_left_as_it_was(stopped_run):
    """rl.num_generations decides the groups advantages are taken in: a resume that changed it would
    mix two runs; it is refused, and the run folder (checkpoints, metrics, config) is left as it was."""
    d, _, step, _ = stopped_run
    before = snapshot(d / "rl")
    path = write_recipe(d / "rl_resume.yaml", **rl_sections(d, "rl", num_generations=4), resume="auto")
    line = user_error_line(run_toolkit("train", path, timeout=300))
    assert f"resume: rl.num_generations was 2 when {d / 'rl' / 'checkpoints' / f'step-{step - 1:06d}'}" in line, line
    assert "now 4; a resumed run must keep its recipe" in line, line
    assert snapshot(d / "rl") == before


def test_convert_of_a_run_folder_names_its_latest_checkpoint(tmp_path, cli):
    """Without a launch: a run folder with two complete checkpoints (their markers) and a final/."""
    run = run_folder_without_checkpoints(tmp_path)
    for step in (1, 2):
        ck = run / "checkpoints" / f"step-{step:06d}"
        ck.mkdir(parents=True)
        (ck / "COMPLETE").write_text("")
        (ck / "trainer_state.json").write_text("{}")
    (run / "final").mkdir()
    line = one_line(*cli("checkpoint", "convert", run, "--out", tmp_path / "hf")[::2])
    assert line == (f"error: checkpoint convert: {run} is a run folder, not a checkpoint; give one of its checkpoints "
                    f"(the latest complete one: {run / 'checkpoints' / 'step-000002'}), or use its final/ as it is "
                    "(a Hugging Face folder already)"), line


@pytest.mark.launch
def test_refusals_after_the_reward_import_and_the_model_build_leave_no_run_folder(tmp_path):
    """A reward file with a syntax error (refused when the run imports it, before the model) and a
    completion longer than the model's positions (refused once the model is built): one line each,
    launched side by side, and no run folder left behind."""
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8))
    (tmp_path / "bad.py").write_text("def score(completions, **kwargs)\n    return [0.0 for c in completions]\n")
    syntax = write_recipe(tmp_path / "syntax.yaml", **rl_sections(tmp_path, "syntax",
                                                                  rewards=[f"{tmp_path / 'bad.py'}:score"]))
    long = write_recipe(tmp_path / "long.yaml", **rl_sections(tmp_path, "long", max_new_tokens=100_000))
    procs = [start([sys.executable, "-m", "toolkit", "train", str(p)]) for p in (syntax, long)]
    results = [finish(p, timeout=300) for p in procs]
    for (code, _, err), expected in zip(results, ("bad.py: raised SyntaxError: expected ':' (bad.py, line 1)",
                                                  "rl.max_new_tokens: a prompt of up to data.max_seq_len=64")):
        line = user_error_line(type("Proc", (), {"returncode": code, "stderr": err}))
        assert expected in line, line
    assert not (tmp_path / "syntax").exists() and not (tmp_path / "long").exists()
