"""A TRL config read as a recipe (toolkit/config/trl_config.py): TRL's own example file verbatim loads; each
mapped field means what TRL's own parser (`TrlParser`, as `trl sft --config` runs it) makes of the same file; the
trainer is found from the fields; the fields not followed are named; one trains end to end; docs/trl-configs.md is
the generated table."""

import pytest
import yaml

from toolkit.config import load_recipe
from toolkit.config.trl_config import reference

from helpers import ROOT, alpaca_rows, read_metrics, run_toolkit, write_jsonl

EXAMPLE = ROOT / "tests" / "trl_configs" / "example_config.yaml"


def test_the_reference_page_is_generated_and_in_sync():
    assert (ROOT / "docs" / "trl-configs.md").read_text() == reference(), "run `make docs`"


def test_trls_example_config_loads_as_trl_reads_it(capsys):
    recipe = load_recipe(EXAMPLE)
    assert recipe.model.path == "Qwen/Qwen2.5-0.5B" and recipe.model.preset is None
    assert recipe.data.train_files[0].path == "stanfordnlp/imdb" and recipe.data.train_files[0].split == "train"
    assert recipe.train.learning_rate == 1e-4 and recipe.train.lr_scheduler_type == "cosine"
    assert recipe.train.report_to == []
    # what the file leaves out is TRL's default, as `trl sft --config` runs it
    assert (recipe.train.micro_batch_size, recipe.train.epochs, recipe.train.optim) == (8, 3, "adamw_torch_fused")
    assert recipe.model.gradient_checkpointing and recipe.data.max_seq_len == 1024
    assert recipe.output_dir.endswith("trainer_output")
    err = capsys.readouterr().err
    assert "read as TRL's SFTConfig (trl sft --config): 5 fields mapped" in err and "every field followed" in err


def trl_parse(path, kind):
    """The file as TRL's own CLI parser reads it: (script, training, model) arguments."""
    from trl import DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser

    config = {"sft": SFTConfig, "dpo": DPOConfig, "grpo": GRPOConfig}[kind]
    # reward_funcs is an argument of TRL's grpo script (GRPOScriptArguments), not of these dataclasses
    return TrlParser((ScriptArguments, config, ModelConfig)).parse_args_and_config(["--config", str(path)],
                                                                                   fail_with_unknown_args=False)


RICH = {"sft": {"model_name_or_path": "/models/m", "dataset_name": "data/chat.jsonl", "dataset_train_split": "train",
                "learning_rate": 3e-5, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                "num_train_epochs": 2, "max_steps": 50, "warmup_steps": 0.1, "lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "weight_decay": 0.01, "max_grad_norm": 0.5,
                "optim": "paged_adamw_8bit", "logging_steps": 5, "save_steps": 25, "save_total_limit": 3,
                "max_length": 2048, "packing": True, "gradient_checkpointing": False, "bf16": True, "seed": 7,
                "use_peft": True, "lora_r": 32, "lora_alpha": 64, "lora_dropout": 0.05, "output_dir": "out/sft",
                "run_name": "trial", "report_to": ["wandb"], "completion_only_loss": False, "push_to_hub": False},
        "dpo": {"model_name_or_path": "/models/m", "dataset_name": "data/pairs.jsonl", "beta": 0.2,
                "learning_rate": 5e-7, "per_device_train_batch_size": 4, "max_length": 512, "output_dir": "out/dpo"},
        "grpo": {"model_name_or_path": "/models/m", "dataset_name": "data/prompts.jsonl", "num_generations": 4,
                 "max_completion_length": 64, "temperature": 0.7, "beta": 0.04, "learning_rate": 1e-6,
                 "per_device_train_batch_size": 8, "epsilon": 0.3, "reward_funcs": ["rewards.py:exact"],
                 "output_dir": "out/grpo"}}
# recipe key -> the attribute of TRL's parsed (script, training, model) arguments it must equal
SAME = {"train.learning_rate": (1, "learning_rate"),
        "train.micro_batch_size": (1, "per_device_train_batch_size"),
        "train.gradient_accumulation_steps": (1, "gradient_accumulation_steps"),
        "train.epochs": (1, "num_train_epochs"),
        "train.max_steps": (1, "max_steps"), "train.lr_scheduler_type": (1, "lr_scheduler_type"),
        "train.weight_decay": (1, "weight_decay"), "train.max_grad_norm": (1, "max_grad_norm"),
        "train.optim": (1, "optim"), "train.log_every_steps": (1, "logging_steps"),
        "checkpoint.every_steps": (1, "save_steps"), "train.run_name": (1, "run_name"), "seed": (1, "seed"),
        "model.gradient_checkpointing": (1, "gradient_checkpointing"), "lora.enabled": (2, "use_peft"),
        "lora.r": (2, "lora_r"), "lora.alpha": (2, "lora_alpha"), "lora.dropout": (2, "lora_dropout"),
        "data.max_seq_len": (1, "max_length"), "data.packing": (1, "packing"), "preference.beta": (1, "beta"),
        "rl.num_generations": (1, "num_generations"), "rl.max_new_tokens": (1, "max_completion_length"),
        "rl.temperature": (1, "temperature"), "rl.beta": (1, "beta"), "rl.epsilon": (1, "epsilon")}


@pytest.mark.parametrize("kind", list(RICH))
def test_each_mapped_field_is_what_trls_parser_reads(kind, tmp_path, capsys):
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump({**RICH[kind], "use_cpu": True}))  # TRL's parser checks bf16 against the device
    (tmp_path / "rewards.py").write_text("def exact(completions, **kw):\n    return [0.0] * len(completions)\n")
    recipe = load_recipe(path) if kind != "grpo" else load_recipe(path, [f"rl.rewards=[{tmp_path}/rewards.py:exact]"])
    parsed = trl_parse(path, kind)
    flat = {f"{s}.{k}": v for s, sec in recipe.to_dict().items() if isinstance(sec, dict) for k, v in sec.items()}
    flat.update(seed=recipe.seed)
    checked = 0
    for key, (which, attr) in SAME.items():
        theirs = getattr(parsed[which], attr, None)
        section = key.split(".")[0]
        if section in ("preference", "rl") and section != {"dpo": "preference", "grpo": "rl"}.get(kind):
            continue
        if key in flat and (attr in RICH[kind] or key in ("train.epochs", "train.micro_batch_size")):
            ours = flat[key]
            theirs = getattr(theirs, "value", theirs)  # enums: their value
            if attr == "max_steps" and theirs == -1:
                theirs = None
            assert ours == theirs, (key, ours, theirs)
            checked += 1
    assert checked >= {"sft": 20, "dpo": 5, "grpo": 8}[kind], checked
    if kind == "sft":
        assert recipe.train.warmup_ratio == 0.1 and recipe.train.warmup_steps == 0  # transformers 5: a ratio
        assert parsed[1].get_warmup_steps(100) == 10
        assert recipe.train.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and recipe.train.precision == "bf16"
        assert recipe.data.train_on_prompt and recipe.train.report_to == ["wandb"] and recipe.checkpoint.keep_last == 3
        assert "not followed here: push_to_hub, use_cpu" in capsys.readouterr().err
    assert recipe.preference.method == ("dpo" if kind == "dpo" else None)
    assert recipe.rl.method == ("grpo" if kind == "grpo" else None)


def test_the_trainer_can_be_named_and_a_recipe_is_never_read_as_a_trl_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "/models/m", "dataset_name": "d.jsonl", "beta": 0.2}))
    assert load_recipe(path).preference.method == "dpo"
    assert load_recipe(path, trl="sft").preference.method is None  # beta is DPO's: named, not followed, under SFT
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "o"), "model": {"preset": "tiny-llama-mini"},
                                      "data": {"train_files": ["d.jsonl"]}}))
    assert load_recipe(recipe).model.preset == "tiny-llama-mini"


def test_the_loss_types_are_what_trls_parser_reads(tmp_path):
    """SFTConfig's loss_type (dft; chunked_nll, deprecated, is nll) becomes train.loss_type, and the file stays
    an SFT config; DPOConfig's loss_type list, loss_weights and discopop_tau become the preference keys."""
    base = {"model_name_or_path": "/models/m", "dataset_name": "d.jsonl", "use_cpu": True}
    for value, want in (("dft", "dft"), ("chunked_nll", "nll")):
        path = tmp_path / f"sft_{value}.yaml"
        path.write_text(yaml.safe_dump({**base, "loss_type": value}))
        recipe, theirs = load_recipe(path), trl_parse(path, "sft")[1]
        assert recipe.preference.method is None and recipe.train.loss_type == want == theirs.loss_type
    path = tmp_path / "mpo.yaml"
    path.write_text(yaml.safe_dump({**base, "loss_type": ["discopop", "sft"], "loss_weights": [1.0, 0.5],
                                    "discopop_tau": 0.1, "f_divergence_type": "alpha_divergence",
                                    "f_alpha_divergence_coef": 0.3}))
    p, theirs = load_recipe(path).preference, trl_parse(path, "dpo")[1]
    keys = ("loss_type", "loss_weights", "discopop_tau", "f_divergence_type", "f_alpha_divergence_coef")
    assert p.method == "dpo" and [getattr(p, k) for k in keys] == [getattr(theirs, k) for k in keys] == [
        ["discopop", "sft"], [1.0, 0.5], 0.1, "alpha_divergence", 0.3]


@pytest.mark.launch
def test_a_trl_sft_config_trains(tmp_path):
    """TRL's example file with the model and the data local (no Hub here), run by `toolkit train` as it is."""
    from test_bad_input import tiny_model_folder

    data = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(16))
    config = yaml.safe_load(EXAMPLE.read_text())
    config.update(model_name_or_path=str(tiny_model_folder(tmp_path)), dataset_name=str(data), max_steps=2,
                  output_dir=str(tmp_path / "out"))
    path = tmp_path / "sft_config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: " in proc.stderr and "read as TRL's SFTConfig" in proc.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "out") if "loss" in r] == [1, 2]
