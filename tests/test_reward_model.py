"""Reward models as rewards of online RL (training/reward_model.py, rl.rewards entries with `model:`): scored as
TRL 1.16's GRPOTrainer scores with one (its own `_calculate_rewards` on a real trainer, chat and text prompts);
what is not a one-label sequence-classification model is refused in one line; a GRPO run trains with one."""

import math

import pytest
import torch

from families import build_family, family_config, family_tokenizer
from helpers import (
    accelerate_launch,
    finish,
    launch_config_for,
    read_metrics,
    run_toolkit,
    start,
    user_error_line,
    write_jsonl,
    write_recipe,
)

CHAT = [[{"role": "user", "content": "Say yes."}], [{"role": "user", "content": "Name a colour, quickly."}]]
TEXT = ["Say yes: ", "Name a colour: "]
ANSWERS = ["yes", "no no no", "red", "a very long answer about colours and more"]


def write_reward_model(folder, labels=1, seed=5):
    from transformers import AutoModelForSequenceClassification

    tokenizer = family_tokenizer("llama3")
    config = family_config("llama3", len(tokenizer), tokenizer)
    config.num_labels = labels
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_model")
    return {"policy": build_family("llama3", root / "policy"), "rm": write_reward_model(root / "rm"),
            "two": write_reward_model(root / "two_labels", labels=2), "root": root}


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["chat", "text", "chat with template kwargs"])
def test_a_reward_model_scores_as_trls_calculate_rewards(folders, kind, tmp_path):
    """`chat with template kwargs`: model.chat_template_kwargs reach the reward model's own template as
    TRL's chat_template_kwargs do (Llama 3's `date_string`, written into its system header)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from toolkit.config import RewardConfig
    from toolkit.training.rewards import load_rewards, score

    chat = kind.startswith("chat")
    kwargs = {"date_string": "01 Jan 2031"} if kind == "chat with template kwargs" else {}
    prompts = [p for p in (CHAT if chat else TEXT) for _ in range(2)]
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                      per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
                      chat_template_kwargs=kwargs or None)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(folders["policy"], dtype=torch.float32),
                          reward_funcs=[str(folders["rm"])], args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=AutoTokenizer.from_pretrained(folders["policy"]))
    completions = [[{"role": "assistant", "content": a}] for a in ANSWERS] if chat else ANSWERS
    want = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, [[1]] * 4)[:, 0]
    rewards = load_rewards([RewardConfig(model=str(folders["rm"]), weight=2.0)], kwargs)
    assert [r.name for r in rewards] == ["rm"]
    total, per = score(rewards, prompts, ANSWERS, [{} for _ in prompts], step=1, rows=[f"row {i}" for i in range(4)])
    torch.testing.assert_close(per["reward_rm"], want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, 2 * want.float(), rtol=1e-5, atol=1e-6)
    assert len(set(per["reward_rm"].tolist())) == 4  # four answers, four scores: the model read each one
    if kwargs:  # the kwargs changed what the reward model read
        plain, _ = score(load_rewards([RewardConfig(model=str(folders["rm"]))]), prompts, ANSWERS,
                         [{} for _ in prompts], step=1, rows=[f"row {i}" for i in range(4)])
        assert not torch.allclose(plain, per["reward_rm"])


def test_what_is_not_a_reward_model_is_refused_in_one_line(folders, tmp_path):
    """Issue 69: a two-label folder whose config.json says otherwise too (id2label of 2 beside num_labels 1, which
    transformers reads as 1; or one label over a head of two rows) was loaded as a one-label model, and the
    traceback came from transformers: refused from config.json and the weights' headers, before loading."""
    import json
    import shutil

    from toolkit.config import RewardConfig, load_recipe
    from toolkit.errors import ToolkitError
    from toolkit.training.rewards import load_rewards

    edited = {"listed": {"num_labels": 1, "id2label": {"0": "bad", "1": "good"}, "label2id": {"bad": 0, "good": 1}},
              "rows": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    for name, keys in edited.items():  # the two-label model, its config.json edited
        shutil.copytree(folders["two"], tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **keys}))
    shutil.copytree(folders["rm"], tmp_path / "vocab")  # a reward model whose config.json's vocab_size was edited
    config = json.loads((tmp_path / "vocab" / "config.json").read_text())
    (tmp_path / "vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 10}))
    cases = [(folders["policy"], "is a LlamaForCausalLM, not a sequence-classification reward model"),
             (folders["two"], "has 2 labels; a reward model has one"),
             (tmp_path / "listed", "has 2 labels; a reward model has one"),
             (tmp_path / "rows", "has a score head of 2 outputs \\(score.weight in its weights\\) where its "
                                 "config.json says 1 label; a reward model has one"),
             (tmp_path / "vocab", "cannot be loaded: its weights do not fit its config.json"),
             (tmp_path / "nowhere", "folder not found")]
    for source, match in cases:
        with pytest.raises(ToolkitError, match=match) as err:
            load_rewards([RewardConfig(model=str(source))])
        assert str(err.value).startswith("rl.rewards[0].model: ") and "\n" not in str(err.value), err.value
    for entry, match in [({"model": str(folders["rm"]), "function": "exact_match"}, "a reward model or a function"),
                         ({"weight": 2.0}, r"rl.rewards\[0\].function: give a function")]:
        path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={"preset": "tiny-llama-mini"},
                            data={"train_files": [str(tmp_path / "p.jsonl")], "format": "prompt"},
                            rl={"method": "grpo", "rewards": [entry]})
        with pytest.raises(ToolkitError, match=match):
            load_recipe(path)


@pytest.mark.launch
def test_grpo_trains_with_a_reward_model(folders):
    """A run whose reward is a reward model beside a function: its metric reward_<folder> is logged every step; under
    ZeRO-3 on 2 processes (which would build the reward model partitioned, empty) every rank scores with it whole, as
    one process does; the model's identity is recorded with the checkpoint, and a resume with another reward model
    is refused."""
    root = folders["root"]
    write_jsonl(root / "prompts.jsonl", [{"prompt": c} for c in CHAT * 4])
    # 5 eval prompts in batches of 2: on 2 ranks one batch is padding only, which is sampled but not scored
    write_jsonl(root / "eval.jsonl", [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(5)])
    path = write_recipe(root / "grpo.yaml", output_dir=str(root / "run"), seed=3,
                        model={"path": str(folders["policy"])},
                        data={"train_files": [str(root / "prompts.jsonl")], "eval_files": [str(root / "eval.jsonl")],
                              "format": "prompt", "max_seq_len": 256},
                        rl={"method": "grpo", "num_generations": 2, "max_new_tokens": 4,
                            "rewards": [{"model": str(folders["rm"])}, {"function": "regex", "pattern": "e"}]},
                        train={"micro_batch_size": 2, "max_steps": 2, "learning_rate": 1e-3, "log_every_steps": 1,
                               "eval_batch_size": 2, "eval_every_steps": 2},
                        checkpoint={"every_steps": 1})
    result = run_toolkit("train", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(root / "run")[1:]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["reward_rm"]) for r in rows)
    assert all(r["reward"] == pytest.approx(r["reward_rm"] + r["reward_regex"]) for r in rows)
    zero3 = accelerate_launch(launch_config_for("zero3", root)) + [
        "toolkit", "train", str(path), f"output_dir={root / 'zero3'}", "train.micro_batch_size=1"]
    rc, out, err = finish(start(zero3))
    assert rc == 0, err[-3000:]
    for mine, theirs in zip(read_metrics(root / "run"), read_metrics(root / "zero3"), strict=True):
        for key in ("reward_rm", "eval_reward", "eval_reward_rm"):
            assert (mine.get(key) is None) == (theirs.get(key) is None), key
            if mine.get(key) is not None:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4), key
    assert read_metrics(root / "run")[-1]["eval_reward_rm"] != 0
    write_reward_model(folders["rm"], seed=6)  # other weights in the same folder
    line = user_error_line(run_toolkit("train", str(path), "train.max_steps=3", "resume=auto"))
    assert "the reward models' weights and config (rl.rewards' model entries) changed" in line, line
