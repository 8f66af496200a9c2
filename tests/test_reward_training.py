"""Reward modelling (preference.method=reward): TRL's RewardTrainer and ours from the same pairs on the
same sequence-classification model agree step for step; a causal LM folder gets a score head drawn from
the seed alone, so DDP, FSDP and ZeRO-3 (which loads it partitioned) on 2 processes equal one process; a
SIGKILL resumes bitwise; final/ loads as AutoModelForSequenceClassification and scores as an rl.rewards
model; bad recipes and margins are refused in one line."""

import json
import math

import pytest
import torch
from objective_runs import assert_runs_close, assert_sigkill_resumes_bitwise, sectioned_recipe, trained

from families import build_family
from helpers import ROOT, load_weights, read_metrics, run_toolkit, write_jsonl, write_recipe

PAIRS = ROOT / "examples" / "data" / "tasks_preference_train.jsonl"
STEPS = 4


def rows(n: int, skip: int = 0) -> list[dict]:
    with open(PAIRS) as f:
        return [json.loads(line) for line in f][skip:skip + n]


def test_the_loss_is_bradley_terry_minus_the_margin_plus_the_centring():
    from toolkit.training.reward_training import pair_score_losses

    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.2, 0.5])
    torch.testing.assert_close(pair_score_losses(chosen, rejected), -torch.nn.functional.logsigmoid(chosen - rejected))
    margins = torch.tensor([0.3, 1.0])
    got = pair_score_losses(chosen, rejected, margins, center=0.01)
    want = -torch.nn.functional.logsigmoid(chosen - rejected - margins) + 0.01 * (chosen + rejected) ** 2
    torch.testing.assert_close(got, want)


def test_margins_are_read_for_reward_models_only_and_a_bad_one_is_refused_by_file_and_row(tmp_path):
    """Numbers, numbers as text (a CSV file's) and null (0) are margins; anything else is refused by
    file and row. Other objectives' data is prepared as before: no margin column, none checked."""
    from transformers import AutoTokenizer

    from toolkit.config.data import DataConfig
    from toolkit.data.prepare import build_datasets
    from toolkit.errors import ToolkitError

    tok = AutoTokenizer.from_pretrained(build_family("llama3", tmp_path / "llama3"))
    good = [{**r, "margin": ("0.5", "1.5", None)[i % 3]} for i, r in enumerate(rows(29))]  # as a CSV file reads
    config = DataConfig(train_files=[str(write_jsonl(tmp_path / "good.jsonl", good))], format="preference",
                        max_seq_len=256)
    made = build_datasets(config, tok, 0, False, margins=True)
    assert [float(x) for x in made.train.table["margin"]] == [(0.5, 1.5, 0.0)[i % 3] for i in range(29)]
    assert "margin" not in build_datasets(config, tok, 0, False).train.table.column_names  # DPO's data
    bad = write_jsonl(tmp_path / "bad.jsonl", good + [{**rows(1)[0], "margin": "big"}])
    config = DataConfig(train_files=[str(bad)], format="preference", max_seq_len=256)
    with pytest.raises(ToolkitError, match="bad.jsonl: row 30: margin must be a finite number, got 'big'"):
        build_datasets(config, tok, 0, False, margins=True)
    assert len(build_datasets(config, tok, 0, False).train) == 30  # DPO does not read the column


def test_liger_kernels_are_refused_on_a_reward_model(tmp_path):
    """Liger patches causal LM classes only (its Gemma 3 patch raises on any other class); refused at
    load. (Where liger-kernel is not installed, as here, the missing package is refused first.)"""
    from toolkit.config import load_recipe
    from toolkit.config.validate_objectives import validate_reward_model

    data = write_jsonl(tmp_path / "pairs.jsonl", rows(4))
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"),
                                      model={"preset": "tiny-llama-mini"}, preference={"method": "reward"},
                                      data={"train_files": [str(data)], "format": "preference"}))
    recipe.model.kernels = "liger"

    def need(ok, key, message):
        if not ok:
            raise ValueError(f"{key}: {message}")

    with pytest.raises(ValueError, match="model.kernels: Liger's kernels patch causal LMs only"):
        validate_reward_model(recipe, need)


def test_a_classifier_of_several_labels_is_refused_and_one_of_one_keeps_its_head(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from toolkit.errors import ToolkitError
    from toolkit.model.load import has_score_head

    base = build_family("llama3", tmp_path / "llama3")
    assert not has_score_head(str(base))  # a causal LM: the run draws a head
    for labels in (1, 2, 3):
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=labels)
        model.save_pretrained(tmp_path / f"labels{labels}")
    assert has_score_head(str(tmp_path / "labels1"))
    for labels in (2, 3):  # transformers leaves id2label out for its default of 2
        with pytest.raises(ToolkitError, match=f"a sequence-classification model with {labels} labels"):
            has_score_head(str(tmp_path / f"labels{labels}"))


def test_a_causal_objective_refuses_a_reward_model_folder(tmp_path):
    """SFT, DPO or RL from a reward model's folder: transformers loads it as a causal LM with a random output
    layer and only warns; refused in one line from its config.json, before it loads."""
    from transformers import AutoModelForSequenceClassification

    from toolkit.config import ModelConfig
    from toolkit.errors import ToolkitError
    from toolkit.model.load import build_model

    base = build_family("llama3", tmp_path / "llama3")
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(tmp_path / "rm")
    with pytest.raises(ToolkitError, match=f"model.path: {tmp_path / 'rm'} is a sequence-classification model "
                                           r"\(a reward model: a score, no output layer\); this recipe trains a "
                                           "causal LM"):
        build_model(ModelConfig(path=str(tmp_path / "rm")))
    assert type(build_model(ModelConfig(path=str(tmp_path / "rm")), scorer=True)).__name__ == \
        "LlamaForSequenceClassification"


@pytest.mark.launch
def test_a_base_of_two_labels_is_refused_before_it_loads(tmp_path):
    """A sequence-classification folder of two labels as model.path is refused in one line from its config.json,
    before transformers loads it as a one-label model (its two-row head does not fit one row: a traceback)."""
    from transformers import AutoModelForSequenceClassification

    from helpers import user_error_line

    base = build_family("llama3", tmp_path / "llama3")
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=2).save_pretrained(tmp_path / "two")
    data = write_jsonl(tmp_path / "pairs.jsonl", rows(4))
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"path": str(tmp_path / "two")},
                        data={"train_files": [str(data)], "format": "preference", "max_seq_len": 256},
                        preference={"method": "reward"}, train={"micro_batch_size": 4, "max_steps": 1})
    line = user_error_line(run_toolkit("train", str(path)))
    assert line == (f"error: model.path: {tmp_path / 'two'} is a sequence-classification model with 2 labels; a "
                    "reward model has one score (num_labels 1): start from its causal LM or a one-label model"), line


# ---- against TRL's own trainer ----

def scorer_folder(tmp_path):
    """A sequence-classification folder (one output, its head drawn here) from the tiny Llama 3."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = build_family("llama3", tmp_path / "llama3")
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(base).pad_token_id
    model.save_pretrained(tmp_path / "scorer")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "scorer")
    return tmp_path / "scorer"


def test_pairs_longer_than_max_seq_len_are_dropped_counted_and_the_same_as_trls(tmp_path):
    """Before issue 69 a reward model trained on pairs cut at data.max_seq_len, its score read
    mid-answer, where TRL's RewardTrainer drops every pair whose chosen or rejected sequence is longer
    than max_length (a pair of exactly max_length stays). Unset, data.overlong is now drop for a reward
    model: the same pairs as TRL's, token for token; the data lines count the dropped ones; none left is
    refused in one line naming data.max_seq_len; data.overlong=truncate still cuts them."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from toolkit.config import load_recipe
    from toolkit.data.prepare import build_datasets
    from toolkit.data.tokenize import tokenize_examples
    from toolkit.errors import ToolkitError

    folder = scorer_folder(tmp_path)
    tok = AutoTokenizer.from_pretrained(folder)
    pairs = rows(6)
    pairs[1]["chosen"][0]["content"] += "x" * 40
    pairs[2]["chosen"][0]["content"] += "y" * 40  # the longest pair kept: exactly max_seq_len
    pairs[3]["rejected"][0]["content"] += "z" * 40
    pairs[4]["prompt"][0]["content"] += " w" * 15
    pairs[4]["chosen"][0]["content"] += "v" * 15
    longest = [max(e["length"] for e in tokenize_examples(r, "preference", tok, 10**6, False)) for r in pairs]
    limit = longest[2]
    assert [n > limit for n in longest] == [False, True, False, True, True, False]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)

    def recipe(**data_keys):
        return load_recipe(write_recipe(tmp_path / "rm.yaml", output_dir=str(tmp_path / "run"),
                                        model={"path": str(folder)}, preference={"method": "reward"},
                                        data={"train_files": [str(data)], "max_seq_len": limit, **data_keys}))

    made = build_datasets(recipe().data, tok, 0, False, margins=True)
    assert any(line.startswith("3 of 6 pairs longer than data.max_seq_len dropped") and "RewardTrainer" in line
               for line in made.lines), made.lines
    args = RewardConfig(output_dir=str(tmp_path / "trl"), max_length=limit, report_to=[], use_cpu=True, bf16=False)
    trainer = RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32),
                            args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok)
    theirs = trainer.train_dataset
    assert len(theirs) == len(made.train) == 3
    for i in range(3):
        assert made.train[i]["input_ids"].tolist() == theirs[i]["chosen_ids"], i
        assert made.train[i]["rejected_input_ids"].tolist() == theirs[i]["rejected_ids"], i
    assert max(len(theirs[i]["chosen_ids"]) for i in range(3)) == limit  # the boundary pair is kept by both
    cut = build_datasets(recipe(overlong="truncate").data, tok, 0, False, margins=True)
    assert len(cut.train) == 6 and any("3 of 6 pairs truncated" in line for line in cut.lines), cut.lines
    short = recipe(max_seq_len=40).data
    with pytest.raises(ToolkitError, match=r"pairs.jsonl: no pairs left after dropping the 6 pairs longer than "
                                           r"data.max_seq_len=40 \(.*RewardTrainer.*\); raise data.max_seq_len"):
        build_datasets(short, tok, 0, False, margins=True)


@pytest.mark.launch
def test_reward_training_matches_trl(tmp_path):
    """Full fine-tuning, one process, fp32, 4 pairs with margins in one global batch,
    center_rewards_coefficient 0.01, AdamW without weight decay, clipping at 1.0, constant learning
    rate, 3 steps: losses, accuracies, margins and gradient norms equal TRL RewardTrainer's within
    1e-5 relative, and the weights after the last step within 1e-5."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    folder = scorer_folder(tmp_path)
    pairs = [{**r, "margin": m} for r, m in zip(rows(4), (0.0, 0.5, 0.0, 1.0))]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    path = write_recipe(tmp_path / "rm.yaml", output_dir=str(tmp_path / "ours"), seed=0, model={"path": str(folder)},
                        data={"train_files": [str(data)], "format": "preference", "max_seq_len": 256},
                        preference={"method": "reward", "center_rewards_coefficient": 0.01},
                        train={"micro_batch_size": 4, "max_steps": 3, "learning_rate": 1e-3, "min_lr_ratio": 1.0,
                               "max_grad_norm": 1.0, "weight_decay": 0.0, "log_every_steps": 1})
    result = run_toolkit("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward model: the folder's score head, trained further" in result.stdout + result.stderr
    ours = read_metrics(tmp_path / "ours")[1:]

    args = RewardConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, learning_rate=1e-3,
                        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=3,
                        logging_steps=1, center_rewards_coefficient=0.01, max_length=256, seed=0, report_to=[],
                        use_cpu=True, bf16=False, save_strategy="no", dataloader_num_workers=0)
    trainer = RewardTrainer(model=AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32),
                            args=args, train_dataset=Dataset.from_list(pairs),
                            processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(theirs) == len(ours) == 3
    for mine, trl in zip(ours, theirs):
        for key, trl_key in (("loss", "loss"), ("reward_margin", "margin"), ("reward_accuracy", "accuracy"),
                             ("grad_norm", "grad_norm")):
            assert mine[key] == pytest.approx(trl[trl_key], rel=1e-5, abs=1e-6), (key, mine, trl)
        assert (mine["rewards_chosen"] + mine["rewards_rejected"]) / 2 == pytest.approx(trl["mean_reward"], abs=1e-6)
    assert ours[2]["loss"] < ours[0]["loss"]  # the steps moved
    weights, start = load_weights(tmp_path / "ours" / "final"), load_weights(folder)
    for name, value in trainer.model.state_dict().items():
        assert (value - start[name]).abs().max() > 1e-3, name  # moved: equality is not of the starting weights
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)


# ---- launched: every layout learns the same ----

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward")
    write_jsonl(root / "train.jsonl", rows(32))
    # 5 eval rows: on 2 ranks in batches of 2, the second rank's last eval batch is padding only
    write_jsonl(root / "eval.jsonl", rows(5, skip=100))
    build_family("llama3", root / "llama3")  # a causal LM: the run draws its score head
    return root


def recipe(workdir, name, layout="single", **extra):
    return sectioned_recipe(workdir / f"{name}.yaml", {
        "output_dir": str(workdir / name), "seed": 5, "model": {"path": str(workdir / "llama3")},
        "data": {"train_files": [str(workdir / "train.jsonl")], "eval_files": [str(workdir / "eval.jsonl")],
                 "format": "preference", "max_seq_len": 256},
        "preference": {"method": "reward"},
        "train": {"micro_batch_size": 4 if layout == "single" else 2, "gradient_accumulation_steps": 2,
                  "max_steps": STEPS, "learning_rate": 1e-3, "eval_every_steps": 2, "log_every_steps": 1,
                  # With the loss near ln 2 many backbone gradients are near 0, and Adam divides each element by
                  # its own size: at epsilon 1e-8 an element's float noise (the losses agree to 1e-7) moved it by
                  # 2e-4 (measured, DDP); at 1e-6 elements that small take plain, proportional steps.
                  "adam_epsilon": 1e-6},
        "checkpoint": {"every_steps": 1, "keep_last": 10},
    }, **extra)


def train(workdir, name, layout="single", **extra):
    return trained(workdir, layout, recipe(workdir, name, layout, **extra))


KEYS = ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "eval_loss", "eval_reward_margin",
        "eval_reward_accuracy")


def assert_close(a, b):
    assert_runs_close(a, b, KEYS, STEPS)


@pytest.fixture(scope="module")
def single(workdir):
    return train(workdir, "single")


@pytest.mark.launch
def test_one_process_trains_a_reward_model_that_scores_as_an_rl_reward(single, workdir):
    """The run logs its pair metrics; final/ is a sequence-classification folder that transformers
    loads and that online RL's reward-model loader scores with, giving the run's own scores."""
    run, log = single
    assert "reward model: a score head of one output on LlamaForSequenceClassification, drawn from the seed" in log
    metrics = read_metrics(run)
    assert all(math.isfinite(r["loss"]) for r in metrics[1:]) and 0 <= metrics[-1]["eval_reward_accuracy"] <= 1
    for row in metrics[1:]:
        assert row["reward_margin"] == pytest.approx(row["rewards_chosen"] - row["rewards_rejected"], abs=1e-6)
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    card = (run / "final" / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "AutoModelForSequenceClassification" in card

    from toolkit.training.reward_model import load_reward_model

    reward = load_reward_model("rl.rewards[0].model", str(run / "final"))
    pair = rows(1, skip=100)[0]
    chosen, rejected = (reward([pair["prompt"]], [pair[k]]) for k in ("chosen", "rejected"))
    assert len(chosen) == len(rejected) == 1 and all(math.isfinite(x) for x in chosen + rejected)


@pytest.mark.launch
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "zero3"])
def test_two_processes_equal_one(layout, workdir, single):
    """The head drawn from the seed alone (ZeRO-3 builds the model partitioned, inside zero.Init): the
    same losses, scores and weights as one process within 1e-4."""
    run, _ = train(workdir, f"full_{layout}", layout)
    assert_close(single[0], run)


@pytest.mark.launch
def test_a_preset_under_zero3_equals_one_process(workdir):
    """A preset's reward model (the quickstart's) under ZeRO-3 on 2 processes: transformers builds a
    sequence-classification model's backbone through from_config, which ZeRO-3 partitions as it is built, and
    then initialised the whole model's weights on empty shards (a traceback on rank 1); it is built whole, as one
    process builds it, and learns the same."""
    extra = {"model": {"preset": "tiny-llama-mini"}, "train__max_steps": 2}
    one, _ = train(workdir, "preset_single", **extra)
    two, _ = train(workdir, "preset_zero3", "zero3", **extra)
    assert_runs_close(one, two, KEYS, 2)


@pytest.mark.launch
@pytest.mark.slow  # DPO's and RL's SIGKILL resumes stay in CI; this one is run by hand before resolving
def test_sigkill_resumes_bitwise(workdir, single):
    assert_sigkill_resumes_bitwise(workdir, recipe(workdir, "killed"), single[0])


@pytest.mark.launch
def test_generate_and_checkpoint_convert_take_a_reward_model_as_what_it_is(workdir, single):
    """`toolkit generate` refuses a reward model in one line (no output layer to write text with) instead of
    loading it as a causal LM; `toolkit checkpoint convert` builds the reward model from a checkpoint, its
    weights those of final/ at the same step."""
    result = run_toolkit("generate", str(single[0] / "final"), "--prompt", "hi")
    assert result.returncode == 2 and "a reward model (sequence classification" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    out = workdir / "converted"
    converted = run_toolkit("checkpoint", "convert", str(single[0] / "checkpoints" / f"step-{STEPS:06d}"),
                            "--out", str(out))
    assert converted.returncode == 0, converted.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] is not None
    want, have = load_weights(single[0] / "final"), load_weights(out)
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
