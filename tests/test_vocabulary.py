"""model.add_special_tokens: new special tokens are single tokens, the embeddings and the output
layer (tied or not) grow to hold them, and the grown model trains, resumes on another layout and
converts like any other (full fine-tuning; with LoRA it is refused in one line)."""

import json
import math
import sys

import pytest
import torch

from families import FAMILIES, build_family
from helpers import (accelerate_launch, launch_config_for, load_weights, read_metrics, run_command, run_toolkit,
                     train_losses, write_jsonl, write_recipe)

NEW = ["<|calc|>", "<|endcalc|>"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocabulary")
    return {f: build_family(f, root / f) for f in ("qwen2.5", "llama3")}


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"], ids=["tied", "untied"])
def test_new_tokens_are_single_and_grow_the_embeddings(family, folders):
    from transformers import AutoModelForCausalLM

    from toolkit.config import ModelConfig
    from toolkit.model import build_model, build_tokenizer, fit_vocabulary

    cfg = ModelConfig(path=str(folders[family]), add_special_tokens=NEW + [FAMILIES[family]["eos"]])
    tokenizer = build_tokenizer(cfg)
    plain = build_tokenizer(ModelConfig(path=str(folders[family])))
    assert len(tokenizer) == len(plain) + 2  # the family's eos is there already
    ids = tokenizer("x <|calc|>1+2<|endcalc|>", add_special_tokens=False)["input_ids"]
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids].count("<|calc|>") == 1 and len(ids) == 7, ids  # x, space, <|calc|>, 1, +, 2, <|endcalc|>
    model = build_model(cfg)
    before = model.get_input_embeddings().weight.detach().clone()
    assert fit_vocabulary(model, tokenizer) == 2
    grown = model.get_input_embeddings().weight
    assert grown.shape == (len(tokenizer), before.shape[1]) and model.config.vocab_size == len(tokenizer)
    assert torch.equal(grown[:len(plain)], before) and torch.isfinite(grown).all()
    assert model.get_output_embeddings().weight.shape[0] == len(tokenizer)
    tied = model.get_output_embeddings().weight is grown
    assert tied == AutoModelForCausalLM.from_pretrained(folders[family]).config.tie_word_embeddings
    assert fit_vocabulary(model, tokenizer) == 0  # rows enough: nothing grows


def test_with_lora_it_is_refused_in_one_line(tmp_path, folders):
    path = write_recipe(tmp_path / "r.yaml", output_dir=str(tmp_path / "run"), model={
        "path": str(folders["llama3"]), "add_special_tokens": NEW}, lora={"enabled": True},
        data={"train_files": [str(tmp_path / "t.jsonl")]})
    from toolkit.config import load_recipe
    from toolkit.errors import ToolkitError

    with pytest.raises(ToolkitError, match="model.add_special_tokens: new tokens need their embedding rows trained"):
        load_recipe(path)  # at load, before anything runs (the CLI prints it as its one line)


def calc_rows(n: int, seed: int) -> list[dict]:
    import random

    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rnd.randint(1, 40), rnd.randint(1, 40)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"<|calc|>{a}+{b}<|endcalc|> {a + b}"}]})
    return rows


@pytest.mark.launch
def test_grown_vocabulary_trains_resumes_on_another_layout_and_converts(tmp_path, folders):
    """Qwen 2.5 (tied embeddings) with two new tokens in its answers: one process for 4 steps; the
    same run resumed from its step-2 checkpoint on 2 processes under ZeRO-3 (the model loaded
    partitioned, grown there) ends where it ended (losses,
    weights within 1e-4); the new rows trained; final/ and `checkpoint convert` load with plain
    transformers, their vocabulary the tokenizer's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = write_jsonl(tmp_path / "train.jsonl", calc_rows(32, 1))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", calc_rows(4, 2))

    def recipe(name, micro):
        return write_recipe(tmp_path / f"{name}.yaml", output_dir=str(tmp_path / name), seed=5,
                            model={"path": str(folders["qwen2.5"]), "add_special_tokens": NEW},
                            data={"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "messages",
                                  "max_seq_len": 128},
                            train={"micro_batch_size": micro, "gradient_accumulation_steps": 2, "max_steps": 4,
                                   "learning_rate": 3e-3, "warmup_steps": 1, "eval_every_steps": 2,
                                   "log_every_steps": 1},
                            checkpoint={"every_steps": 2, "keep_last": 5})

    proc = run_toolkit("train", recipe("one", 4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "embeddings grown by 2 rows" in proc.stdout + proc.stderr
    audit = next(line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("data: first"))
    assert "[[<|calc|>" in audit, audit  # one token, and a target
    one = tmp_path / "one"
    checkpoint = one / "checkpoints" / "step-000002"
    proc = run_toolkit("train", recipe("moved", 2), f"resume={checkpoint}",
                       launcher=accelerate_launch(launch_config_for("zero3", tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run: backend DeepSpeed ZeRO-3" in proc.stderr and "embeddings grown by 2 rows" in proc.stdout + proc.stderr
    want, have = train_losses(one), [r["loss"] for r in read_metrics(tmp_path / "moved") if "loss" in r]
    assert len(want) == 4 and len(have) == 2 and all(math.isfinite(x) for x in want)
    assert have == pytest.approx(want[2:], rel=1e-4), (want, have)
    final, moved = load_weights(one / "final"), load_weights(tmp_path / "moved" / "final")
    assert final.keys() == moved.keys()
    for k in final:
        torch.testing.assert_close(moved[k], final[k], rtol=1e-4, atol=1e-4, msg=k)

    tokenizer = AutoTokenizer.from_pretrained(one / "final")
    new_ids = tokenizer.convert_tokens_to_ids(NEW)
    model = AutoModelForCausalLM.from_pretrained(one / "final")
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == max(new_ids) + 1
    out = tmp_path / "converted"
    proc = run_command([sys.executable, "-m", "toolkit", "checkpoint", "convert", str(checkpoint), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    at_two = AutoModelForCausalLM.from_pretrained(out).get_input_embeddings().weight
    assert at_two.shape == model.get_input_embeddings().weight.shape
    assert len(AutoTokenizer.from_pretrained(out)) == len(tokenizer)
    trained = model.get_input_embeddings().weight
    assert not torch.equal(trained[new_ids], at_two[new_ids])  # the new rows kept training after step 2
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(tokenizer)
