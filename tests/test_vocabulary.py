"""model.add_special_tokens: new special tokens are single tokens, the embeddings and the output
layer (tied or not) grow to hold them, and the grown model trains, resumes on another layout and
converts like any other; with LoRA their rows train whole beside the adapter (peft's trainable
tokens), and merge, generate and convert grow the base to carry them."""

import json
import math
import shutil
import sys

import pytest
import torch

from families import FAMILIES, build_family
from helpers import (
    accelerate_launch,
    launch_config_for,
    load_weights,
    read_metrics,
    run_command,
    run_toolkit,
    train_losses,
    user_error_line,
    write_jsonl,
    write_recipe,
)

NEW = ["<|calc|>", "<|endcalc|>"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocabulary")
    return {f: build_family(f, root / f) for f in ("qwen2.5", "llama3")}


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"], ids=["tied", "untied"])
def test_new_tokens_are_single_and_grow_the_embeddings(family, folders):
    from transformers import AutoModelForCausalLM

    from toolkit.config import ModelConfig
    from toolkit.model.load import build_model, build_tokenizer, fit_vocabulary

    cfg = ModelConfig(path=str(folders[family]), add_special_tokens=NEW + [FAMILIES[family]["eos"]])
    tokenizer = build_tokenizer(cfg)
    plain = build_tokenizer(ModelConfig(path=str(folders[family])))
    assert len(tokenizer) == len(plain) + 2  # the family's eos is there already
    ids = tokenizer("x <|calc|>1+2<|endcalc|>", add_special_tokens=False)["input_ids"]
    # x, space, <|calc|>, 1, +, 2, <|endcalc|>
    assert [tokenizer.convert_ids_to_tokens(i) for i in ids].count("<|calc|>") == 1 and len(ids) == 7, ids
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


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"], ids=["tied", "untied"])
def test_with_lora_the_token_rows_train_whole_beside_the_adapter(family, folders):
    """The rows of the listed tokens and every added row train (in an untied output layer too; a tied
    one shares them), and nothing else of the embeddings; an output layer both in lora.target_modules
    and holding trained rows is refused in one line."""
    from toolkit.config import LoraConfig, ModelConfig
    from toolkit.errors import ToolkitError
    from toolkit.model.load import apply_lora, build_model, build_tokenizer, fit_vocabulary, token_rows

    eos = FAMILIES[family]["eos"]  # already a token, listed: its row trains too (a base's reserved chat token)
    cfg = ModelConfig(path=str(folders[family]), add_special_tokens=NEW + [eos])
    tokenizer = build_tokenizer(cfg)
    model = build_model(cfg)
    added = fit_vocabulary(model, tokenizer)
    rows = token_rows(model, tokenizer, cfg.add_special_tokens, added)
    assert rows == sorted(tokenizer.convert_tokens_to_ids(NEW + [eos])) and added == 2
    if family == "llama3":
        with pytest.raises(ToolkitError, match="lora.target_modules: lm_head is the output layer"):
            apply_lora(build_model(cfg), LoraConfig(enabled=True, r=4, target_modules=["q_proj", "lm_head"]), rows)
    model = apply_lora(model, LoraConfig(enabled=True, r=4), rows)
    deltas = {n: p for n, p in model.named_parameters() if p.requires_grad and "trainable_tokens" in n}
    assert {n.split(".token_adapter")[0].rsplit(".", 1)[-1] for n in deltas} == (
        {"embed_tokens"} if family == "qwen2.5" else {"embed_tokens", "lm_head"}), sorted(deltas)
    assert all(p.shape == (len(rows), model.config.hidden_size) for p in deltas.values())
    ids = torch.tensor([tokenizer("a <|calc|>1+2<|endcalc|> 3", add_special_tokens=False)["input_ids"]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in deltas.values())
    frozen = [n for n, p in model.named_parameters() if ("embed_tokens" in n or "lm_head" in n)
              and "trainable_tokens" not in n and p.requires_grad]
    assert frozen == []


def calc_rows(n: int, seed: int) -> list[dict]:
    import random

    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rnd.randint(1, 40), rnd.randint(1, 40)
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"<|calc|>{a}+{b}<|endcalc|> {a + b}"}]})
    return rows


def calc_recipe(tmp_path, name, base, micro, train, evaluation, learning_rate, eval_every_steps, **sections):
    """A 4-step run of `base` with NEW added, on calc_rows, checkpointing at steps 2 and 4."""
    return write_recipe(tmp_path / f"{name}.yaml", output_dir=str(tmp_path / name), seed=5,
                        model={"path": str(base), "add_special_tokens": NEW},
                        data={"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "messages",
                              "max_seq_len": 128},
                        train={"micro_batch_size": micro, "gradient_accumulation_steps": 2, "max_steps": 4,
                               "learning_rate": learning_rate, "warmup_steps": 1, "eval_every_steps": eval_every_steps,
                               "log_every_steps": 1},
                        checkpoint={"every_steps": 2, "keep_last": 5}, **sections)


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
        return calc_recipe(tmp_path, name, folders["qwen2.5"], micro, train, evaluation, 3e-3, eval_every_steps=2)

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


@pytest.mark.launch
def test_lora_token_rows_resume_on_another_layout_merge_generate_and_convert(tmp_path, folders):
    """Llama 3 (untied output layer) under LoRA with two new tokens: one process for 4 steps, the same
    run resumed at step 2 on 2 processes under FSDP ends where it ended (losses and adapter, token
    rows included, within 1e-4; ZeRO-3 is refused in one line on a host without CUDA, where peft
    cannot build the rows); `toolkit eval` of the adapter gives the run's last eval loss; `toolkit merge` (its logits check against base + adapter over the grown
    base) writes a model whose vocabulary is the tokenizer's and whose new rows are the trained ones;
    `generate` loads the adapter over the original base; `checkpoint convert` merges the step-2 adapter
    into the grown base the same way."""  # noqa: E501
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.model.inference import load_for_inference

    train = write_jsonl(tmp_path / "train.jsonl", calc_rows(32, 1))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", calc_rows(4, 2))

    def recipe(name, micro):
        return calc_recipe(tmp_path, name, folders["llama3"], micro, train, evaluation, 1e-2, eval_every_steps=4,
                           lora={"enabled": True, "r": 4, "alpha": 8})

    proc = run_toolkit("train", recipe("one", 4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "with LoRA, 2 embedding rows train whole (peft trainable tokens)" in proc.stdout + proc.stderr
    one = tmp_path / "one"
    checkpoint = one / "checkpoints" / "step-000002"
    proc = run_toolkit("train", recipe("moved", 2), f"resume={checkpoint}",
                       launcher=accelerate_launch(launch_config_for("fsdp", tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run: backend FSDP" in proc.stderr
    want, have = train_losses(one), [r["loss"] for r in read_metrics(tmp_path / "moved") if "loss" in r]
    assert len(want) == 4 and have == pytest.approx(want[2:], rel=1e-4), (want, have)
    adapter = load_file(str(one / "final" / "adapter_model.safetensors"))
    moved = load_file(str(tmp_path / "moved" / "final" / "adapter_model.safetensors"))
    assert adapter.keys() == moved.keys()
    rows = {k: v for k, v in adapter.items() if "trainable_tokens" in k}
    assert len(rows) == 2, sorted(adapter)  # the input embeddings' and the output layer's
    for k in adapter:
        torch.testing.assert_close(moved[k], adapter[k], rtol=1e-4, atol=1e-4, msg=k)

    merged = tmp_path / "merged"
    proc = run_command([sys.executable, "-m", "toolkit", "merge", str(one / "final"), "--out", str(merged)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 embedding rows trained whole" in proc.stdout and "check: " in proc.stdout, proc.stdout
    tokenizer = AutoTokenizer.from_pretrained(merged)
    new_ids = tokenizer.convert_tokens_to_ids(NEW)
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer) == max(new_ids) + 1
    embed_rows = next(v for k, v in rows.items() if "embed_tokens" in k)
    torch.testing.assert_close(model.get_input_embeddings().weight[new_ids], embed_rows)
    head_rows = next(v for k, v in rows.items() if "lm_head" in k)
    torch.testing.assert_close(model.get_output_embeddings().weight[new_ids], head_rows)

    bare = tmp_path / "adapter_without_tokenizer"  # from elsewhere, without the run's tokenizer: refused
    shutil.copytree(one / "final", bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*",
                                                                       "special_tokens_map.json", "added_tokens.json"))
    proc = run_command([sys.executable, "-m", "toolkit", "merge", str(bare), "--out", str(tmp_path / "m2")])
    assert user_error_line(proc).startswith(f"error: merge: {bare} trains token rows up to {max(new_ids)}, beyond the ")
    assert not (tmp_path / "m2").exists()

    peft_model, peft_tokenizer = load_for_inference(str(one / "final"))  # the original base, grown on load
    ids = torch.tensor([tokenizer("x <|calc|>1+2", add_special_tokens=False)["input_ids"]])
    torch.testing.assert_close(peft_model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert len(peft_tokenizer) == len(tokenizer)
    proc = run_toolkit("eval", one / "final", "--data", evaluation, "--max-new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]  # its chunked-loss check had met peft's token wrapper
    logged = [r["eval_loss"] for r in read_metrics(one) if "eval_loss" in r][-1]
    assert json.loads(proc.stdout)["loss"] == pytest.approx(logged, rel=1e-4)

    out = tmp_path / "converted"
    proc = run_command([sys.executable, "-m", "toolkit", "checkpoint", "convert", str(checkpoint), "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]  # the step-2 adapter, merged into the grown base
    at_two = AutoModelForCausalLM.from_pretrained(out).get_input_embeddings().weight
    assert at_two.shape == model.get_input_embeddings().weight.shape
    assert not torch.equal(at_two[new_ids], embed_rows)  # the rows kept training after step 2

    if not torch.cuda.is_available():
        proc = run_toolkit("train", recipe("on_zero3", 2),
                           launcher=accelerate_launch(launch_config_for("zero3", tmp_path)))
        assert user_error_line(proc, launched=True) == (
            "error: model.add_special_tokens: with LoRA under ZeRO-3 it needs CUDA (peft builds the trained token "
            "rows on a CUDA device); on this host use DDP, FSDP or ZeRO-1/2")
