"""A real model, tokenizer and chat template: SmolLM2-135M-Instruct (BPE, ChatML template, tied
embeddings, 30 layers), fetched by tests/fetch_real_model.sh and skipped where it cannot be.

The rest of the suite trains a byte-level preset built locally; these tests check what only a real
checkpoint exercises: response-only labels under a template the toolkit did not write, packing
isolation on a pretrained architecture, a LoRA run that learns, and ZeRO-3 loading the model
already partitioned (`zero3_init_flag`), which presets never do.
"""

import json
import random
import sys

import pytest
import torch

from helpers import ROOT, load_weights, read_metrics, run_toolkit, train_losses, write_jsonl, write_recipe

pytestmark = [pytest.mark.real_model, pytest.mark.launch]  # every test here starts processes

END_OF_TURN = "<|im_end|>"  # SmolLM2's ChatML end of turn, also its eos token


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from toolkit.config import ModelConfig
    from toolkit.model.load import build_tokenizer

    return build_tokenizer(ModelConfig(path=str(real_model_dir)))


def labelled_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The labelled tokens, as maximal runs of consecutive positions."""
    from toolkit.data.formats import IGNORE

    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE:
            assert label == token  # labels are the inputs themselves; the loss shifts them
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("system", ["You are terse.", None])
def test_chat_template_labels_only_assistant_turns(tokenizer, system):
    """Two assistant turns under the real ChatML template (with a system turn, and without one,
    where the template writes its own default system prompt): exactly the assistant turns are
    labelled, each as its content, the end-of-turn token (one special token, not its characters)
    and the newline the template writes after it. tests/test_data.py pins the same convention on
    the byte-level template: a turn's labels are everything the turn adds to the rendering."""
    from toolkit.data.formats import IGNORE
    from toolkit.data.tokenize import tokenize_example

    users, answers = ["Capital of France?", "And of Italy, briefly?"], ["Paris.", "Rome, of course."]
    messages = [{"role": "system", "content": system}] if system else []
    for user, answer in zip(users, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    ex = tokenize_example({"messages": messages}, "messages", tokenizer, 512, False)
    ids, labels = ex["input_ids"], ex["labels"]
    assert len(ids) == len(labels) == ex["length"]

    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert end_id == tokenizer.eos_token_id and ids.count(end_id) == len(messages) + (system is None)

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    runs = labelled_runs(ids, labels)
    assert runs == [enc(a) + [end_id] + enc("\n") for a in answers], [tokenizer.decode(r) for r in runs]
    assert [tokenizer.decode(r) for r in runs] == [a + END_OF_TURN + "\n" for a in answers]
    assert ex["n_targets"] == sum(map(len, runs))
    unlabelled = tokenizer.decode([t for t, label in zip(ids, labels) if label == IGNORE])
    for text in users + ([system] if system else ["You are a helpful AI assistant named SmolLM"]):
        assert text in unlabelled  # rendered, and not labelled
    assert unlabelled.count("<|im_start|>assistant\n") == 2  # the turn headers are prompt


@pytest.mark.parametrize("inp", ["abc def", ""])
def test_alpaca_labels_only_the_response(tokenizer, inp):
    from toolkit.data.formats import IGNORE
    from toolkit.data.tokenize import tokenize_example

    row = {"instruction": "Reverse the words.", "input": inp, "output": "fed cba"}
    ex = tokenize_example(row, "alpaca", tokenizer, 512, False)
    ids, labels = ex["input_ids"], ex["labels"]
    assert ids[0] == tokenizer.bos_token_id and labels[0] == IGNORE
    runs = labelled_runs(ids, labels)
    assert len(runs) == 1 and runs[0][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(runs[0]) == "fed cba" + END_OF_TURN
    assert ids[-len(runs[0]):] == runs[0]  # the response ends the example
    prompt = tokenizer.decode(ids[: len(ids) - len(runs[0])])
    assert "Reverse the words." in prompt and prompt.endswith("### Response:\n")
    assert ("### Input:\nabc def" in prompt) == bool(inp)


class DropsPositions(torch.nn.Module):
    """The model, called without position_ids: packed documents then run on as one sequence."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.model(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_is_isolated_on_the_real_model(real_model_dir, attn):
    """The start-up check passes on the real architecture, and is not vacuous there: the same
    model fed packed rows without restarting positions fails it."""
    from toolkit.config import ModelConfig
    from toolkit.data.batching import packing_is_isolated
    from toolkit.model.load import build_model

    model = build_model(ModelConfig(path=str(real_model_dir), attn_implementation=attn))
    assert model.config._attn_implementation == attn
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert packing_is_isolated(model)
    assert not packing_is_isolated(DropsPositions(model))


def capital_code_rows(words: list[str]) -> list[dict]:
    """A task with a fixed answer pattern: the code is the name's first three letters in capitals
    and its length, e.g. Benumi -> Code: BEN-6."""
    return [{"messages": [{"role": "system", "content": "Answer with the code only."},
                          {"role": "user", "content": f"What is the capital code of {w}?"},
                          {"role": "assistant", "content": f"Code: {w[:3].upper()}-{len(w)}"}]}
            for w in words]


@pytest.fixture(scope="module")
def capital_data(tmp_path_factory):
    rng = random.Random(0)
    words = set()
    while len(words) < 80:
        words.add("".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3)).capitalize())
    words = sorted(words)
    d = tmp_path_factory.mktemp("capital")
    return (write_jsonl(d / "train.jsonl", capital_code_rows(words[:64])),
            write_jsonl(d / "eval.jsonl", capital_code_rows(words[64:])))


def real_recipe(model_dir, train, evaluation, out, **train_overrides) -> dict:
    return {
        "output_dir": str(out), "seed": 3,
        "model": {"path": str(model_dir)},
        "lora": {"enabled": True, "r": 8, "alpha": 16, "target_modules": "all-linear"},
        "data": {"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "messages",
                 "max_seq_len": 128, "packing": True},
        "train": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "max_steps": 16, "learning_rate": 1e-3,
                  "warmup_steps": 2, "precision": "fp32", "log_every_steps": 1, **train_overrides},
    }


def eval_loss_unpacked(model, tokenizer, eval_file) -> float:
    """The eval loss recomputed outside the training code, one padded batch of unpacked examples."""
    from toolkit.config import DataConfig
    from toolkit.data.batching import Collator
    from toolkit.data.formats import IGNORE
    from toolkit.data.prepare import build_datasets

    data = build_datasets(DataConfig(train_files=[str(eval_file)], format="messages", max_seq_len=128),
                          tokenizer, 0, False)
    batch = Collator(tokenizer.pad_token_id)(data.train)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE).item()


def test_lora_learns_and_reloads_with_peft(tmp_path, real_model_dir, capital_data, tokenizer):
    """16 steps of LoRA (r 8, all-linear; one packed row of 128 tokens, ~3 examples, per step): the held-out eval loss falls far
    below the pretrained model's, and final/ is an adapter that peft loads onto the base folder,
    giving the logged eval loss again."""  # noqa: E501
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    train, evaluation = capital_data
    out = tmp_path / "run"
    proc = run_toolkit("train",
                       write_recipe(tmp_path / "lora.yaml", **real_recipe(real_model_dir, train, evaluation, out)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "padding instead of packing" not in proc.stdout + proc.stderr
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(17))
    before, after = rows[0]["eval_loss"], rows[-1]["eval_loss"]
    # Measured 2026-11-23: eval loss 3.61 before, 0.155 after (ratio 0.043); the first five train
    # losses average 2.39, the last five 0.26 (single packed rows: noisy, 0.04 to 0.66).
    assert after < 0.25 * before, (before, after)
    losses = train_losses(out)
    assert sum(losses[-5:]) / 5 < 0.4 * sum(losses[:5]) / 5, losses

    final = out / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    adapter = load_weights(final)
    # all-linear: q, k, v, o, gate, up, down in each of the 30 layers, A and B each; never the tied head
    assert len(adapter) == 30 * 7 * 2 and all("lora_" in k and v.numel() > 0 for k, v in adapter.items())
    base = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, final).eval()
    # Packed (the run) vs. unpacked (here) eval batches: measured 5e-7 relative.
    assert eval_loss_unpacked(model, tokenizer, evaluation) == pytest.approx(after, rel=1e-4)
    with model.disable_adapter():
        assert eval_loss_unpacked(model, tokenizer, evaluation) == pytest.approx(before, rel=1e-4)


def zero3_launch_config(workdir):
    """The shipped zero3.yaml (zero3_init_flag: the model is loaded already partitioned) with its
    JSON's persistence threshold at 0, so the LoRA matrices are partitioned too and a save that
    forgot to gather would be caught (as in tests/test_backends.py)."""
    import yaml

    launch = yaml.safe_load((ROOT / "accelerate_configs" / "zero3.yaml").read_text())
    ds = json.loads((ROOT / launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (workdir / "launch_zero3.json").write_text(json.dumps(ds))
    launch["deepspeed_config"]["deepspeed_config_file"] = str(workdir / "launch_zero3.json")
    (workdir / "launch_zero3.yaml").write_text(yaml.safe_dump(launch))
    return workdir / "launch_zero3.yaml"


# Measured 2026-11-23 (2 CPU cores, fp32, 3 LoRA steps, unpacked): step 1 equal to the last bit,
# steps 2-3 within 7.6e-7 relative, eval losses within 6e-7, grad norms within 3e-7. The tiny
# model's backends differ by less (test_backends.py); 30 layers of all-reduced gradient shards
# add rounding. 5e-6 is the tightest bound with a few times that margin.
ZERO3_RTOL = 5e-6


@pytest.mark.slow  # 150 s; by hand before resolving (tests/test_backends.py holds ZeRO-3 = one process in CI)
def test_zero3_two_processes_match_one(tmp_path, real_model_dir, capital_data):
    """`accelerate launch` with the shipped ZeRO-3 config, 2 gloo processes (micro 1 x accumulation
    2 x 2), against one process (micro 2 x 2), packed: the same global batch learns the same losses
    and adapter. (The model loads partitioned under zero.Init; the packing check once ran a forward
    on those empty placeholders and crashed: `Padding_idx must be within num_embeddings`.)"""
    packing = True
    train, evaluation = capital_data
    few = write_jsonl(tmp_path / "eval4.jsonl", [json.loads(line) for line in evaluation.read_text().splitlines()[:4]])
    common = {"max_steps": 3, "warmup_steps": 1, "gradient_accumulation_steps": 2}
    recipes = {}
    for name, micro in (("zero3", 1), ("single", 2)):
        recipe = real_recipe(real_model_dir, train, few, tmp_path / name, micro_batch_size=micro, **common)
        recipe["data"]["packing"] = packing
        recipes[name] = write_recipe(tmp_path / f"{name}.yaml", **recipe)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(zero3_launch_config(tmp_path)),
                "--num_processes", "2", "--main_process_port", "0", "-m"]
    proc = run_toolkit("train", recipes["zero3"], launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "run: backend DeepSpeed ZeRO-3, 2 processes" in proc.stderr
    assert "padding instead of packing" not in proc.stdout + proc.stderr
    proc = run_toolkit("train", recipes["single"])
    assert proc.returncode == 0, proc.stderr[-3000:]

    ref, got = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "zero3")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [0, 1, 2, 3]
    for key in ("loss", "eval_loss", "grad_norm"):
        want = [r[key] for r in ref if key in r]
        have = [r[key] for r in got if key in r]
        assert len(have) == len(want) > 0, key
        rel = max(abs(a - b) / abs(a) for a, b in zip(want, have))
        print(f"\nzero3 vs single, packing {packing}: {key} max relative difference {rel:.2e}")
        assert rel <= ZERO3_RTOL, (key, want, have)
    losses = train_losses(tmp_path / "single")
    assert losses[-1] < losses[0]  # it learned, so equal losses are not trivially equal

    # The adapters, compared by relative Frobenius norm rather than element by element: Adam's first
    # updates are about lr * sign(gradient), so the few elements whose gradient is near 0 (or near
    # eps) turn rounding into differences of up to ~0.1 lr. Measured 2026-11-23: 36 of 2.4M
    # elements differ by more than 1e-5 (at most 9.6e-5); per tensor |dW|/|W| at most 3.0e-4
    # (a lora_B), over the whole adapter 8.4e-6. A save that lost the gathering, a rank's shard
    # or the training (lora_B still 0) is off by 1 or more.
    want, have = load_weights(tmp_path / "single" / "final"), load_weights(tmp_path / "zero3" / "final")
    assert want.keys() == have.keys() and len(want) == 30 * 7 * 2
    for k in want:
        assert have[k].shape == want[k].shape and want[k].norm() > 0, k
        assert (have[k] - want[k]).norm() / want[k].norm() <= 1e-2, k
    flat_want, flat_have = (torch.cat([w[k].flatten() for k in sorted(want)]) for w in (want, have))
    assert (flat_have - flat_want).norm() / flat_want.norm() <= 1e-4


def quickstart_rows(tmp_path, kind: str) -> tuple:
    """The first 512 train and 100 eval rows of the quickstart's `kind` files (preference, unpaired)."""
    data = ROOT / "examples" / "data"
    return tuple(write_jsonl(tmp_path / f"{part}.jsonl",
                             [json.loads(x) for x in
                              (data / f"tasks_{kind}_{part}.jsonl").read_text().splitlines()[:n]])
                 for part, n in (("train", 512), ("eval", 100)))


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy(tmp_path, real_model_dir):
    """LoRA DPO (β 0.1, the reference the disabled adapter) on the quickstart's preference pairs
    (a right and a wrong answer to letter, count and sum tasks), 16 steps of 8 pairs: on 100 held-out
    pairs the preference loss falls from ln 2 and the reward accuracy rises from 0, and `toolkit
    eval` on final/ gives the run's last reward accuracy.
    Measured 2026-11-26 (2 CPU cores, 512 train pairs, 3.9 s per step): eval_loss 0.693 -> 0.553,
    eval_reward_accuracy 0 -> 0.73 after 16 steps (0.487 and 0.74 after 32); the chosen answer more
    likely than the rejected one in 67% of pairs for the base model, 71% after 32 steps."""
    train, evaluation = quickstart_rows(tmp_path, "preference")
    out = tmp_path / "run"
    path = write_recipe(tmp_path / "dpo.yaml", output_dir=str(out), seed=42, model={"path": str(real_model_dir)},
                        lora={"enabled": True, "r": 8, "alpha": 16},
                        data={"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "preference",
                              "max_seq_len": 128},
                        preference={"method": "dpo", "beta": 0.1},
                        train={"micro_batch_size": 8, "max_steps": 16, "learning_rate": 5e-4, "warmup_steps": 2,
                               "log_every_steps": 8})
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = read_metrics(out)[0], read_metrics(out)[-1]
    assert first["eval_loss"] == pytest.approx(0.6931, abs=1e-3) and first["eval_reward_accuracy"] == 0
    assert last["eval_loss"] < 0.62 and last["eval_reward_accuracy"] > 0.6 and last["eval_reward_margin"] > 0.1, last
    evaluated = run_toolkit("eval", str(out / "final"), "--data", str(evaluation), "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert json.loads(evaluated.stdout)["preference"]["reward_accuracy"] == pytest.approx(last["eval_reward_accuracy"])


@pytest.mark.slow
def test_kto_raises_held_out_reward_margin(tmp_path, real_model_dir):
    """LoRA KTO (β 0.1, the reference the disabled adapter) on the quickstart's unpaired rows (a right
    answer labelled desirable or a wrong one labelled undesirable), 16 steps of 8 rows: on 100
    held-out rows the implied reward of the desirable answers rises above the undesirable ones'
    (eval_reward_margin from 0), and the eval loss falls from 0.5."""
    train, evaluation = quickstart_rows(tmp_path, "unpaired")
    out = tmp_path / "run"
    path = write_recipe(tmp_path / "kto.yaml", output_dir=str(out), seed=42, model={"path": str(real_model_dir)},
                        lora={"enabled": True, "r": 8, "alpha": 16},
                        data={"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "unpaired",
                              "max_seq_len": 128},
                        preference={"method": "kto", "beta": 0.1},
                        train={"micro_batch_size": 8, "max_steps": 16, "learning_rate": 5e-4, "warmup_steps": 2,
                               "log_every_steps": 8, "eval_every_steps": 8})
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    first, last = metrics[0], metrics[-1]
    print([(r["step"], r.get("eval_loss"), r.get("eval_kl"), r.get("eval_reward_margin")) for r in metrics
           if "eval_loss" in r])
    assert first["eval_loss"] == pytest.approx(0.5, abs=1e-4) and first["eval_reward_margin"] == pytest.approx(0)
    assert last["eval_loss"] < first["eval_loss"] and last["eval_reward_margin"] > 0.1, last


@pytest.mark.slow
def test_reward_model_raises_held_out_pair_accuracy(tmp_path, real_model_dir):
    """A reward model from SmolLM2 (a score head drawn from the seed, every weight trained) on the
    quickstart's preference pairs, 24 steps of 8 pairs: on 100 held-out pairs the share whose right
    answer scores higher rises, and the eval loss falls."""
    train, evaluation = quickstart_rows(tmp_path, "preference")
    out = tmp_path / "run"
    path = write_recipe(tmp_path / "rm.yaml", output_dir=str(out), seed=42, model={"path": str(real_model_dir)},
                        data={"train_files": [str(train)], "eval_files": [str(evaluation)], "format": "preference",
                              "max_seq_len": 128},
                        preference={"method": "reward"},
                        train={"micro_batch_size": 8, "max_steps": 24, "learning_rate": 2e-5, "warmup_steps": 2,
                               "log_every_steps": 8, "eval_every_steps": 12})
    proc = run_toolkit("train", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    print([(r["step"], r.get("eval_loss"), r.get("eval_reward_accuracy")) for r in metrics if "eval_loss" in r])
    first, last = metrics[0], metrics[-1]
    assert last["eval_reward_accuracy"] > first["eval_reward_accuracy"] + 0.1 and last["eval_loss"] < first["eval_loss"]


# 96 nouns: after a seeded shuffle, 64 train and 32 are held out.
NOUNS = """apple bread chair drum eagle flame grape house igloo jelly kite lemon mango nest olive piano queen
river snake tiger umbrella violin whale yacht zebra anchor basket candle dragon engine forest garden hammer island
jacket kettle ladder magnet needle orange pencil quilt rabbit saddle tomato uncle valley window yellow zipper
arrow banana castle desert elbow feather guitar helmet insect jungle kitten lizard marble napkin ocean parrot
rocket silver tunnel velvet wagon butter cotton donkey finger goose honey lamp mirror nose pillow ribbon spoon
tooth vase wheel bottle carpet dinner fabric gravel hero ink juice knife lake""".split()


def first_letter_prompts(words: list[str]) -> list[dict]:
    """One-shot chat prompts: the first letter of a word, to be answered with the letter alone."""
    return [{"prompt": [{"role": "system", "content": "Answer with one letter."},
                        {"role": "user", "content": "First letter of 'duck'?"}, {"role": "assistant", "content": "d"},
                        {"role": "user", "content": f"First letter of '{w}'?"}], "answer": w[0]} for w in words]


def first_letter_run(tmp_path, model: dict, rl: dict, train: dict, **extra) -> list[dict]:
    """An online run (rl) on 64 first-letter prompts, 32 held out, trained on one thread: its metrics rows.
    One thread, as test_qlora.py: with two threads on the 2 shared cores a step waited on a thread another
    process had preempted (68 s of sampling where the step before took 4 s)."""
    words = list(NOUNS)
    random.Random(0).shuffle(words)
    files = write_jsonl(tmp_path / "train.jsonl", first_letter_prompts(words[:64]))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", first_letter_prompts(words[64:]))
    out = tmp_path / "run"
    path = write_recipe(tmp_path / "run.yaml", output_dir=str(out), seed=3, model=model,
                        data={"train_files": [str(files)], "eval_files": [str(evaluation)], "format": "prompt",
                              "max_seq_len": 128},
                        rl=rl, train={"precision": "fp32", "log_every_steps": 1, **train}, **extra)
    proc = run_toolkit("train", path, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)


@pytest.mark.slow
def test_grpo_raises_held_out_reward(tmp_path, real_model_dir):
    """LoRA GRPO (r 16, all-linear) with a verifiable reward: exact_match of the sampled answer against
    the word's first letter. 12 steps of 4 prompts x 8 completions on 64 words. On 32 held-out words
    (one answer each, sampled at temperature 1, the same seeds at every evaluation), eval_reward rises
    well above the base model's, and the train reward of the last steps is above the first steps'.
    The base model answers with the letter alone about a quarter of the time; otherwise it gives a
    word ('capsules.'), a mix ('b2ASANTA') or a sentence, so at step 1 every group has reward spread.
    Measured 2026-11-27 (2 shared CPU cores, one thread; 230 s, 15 s a step): eval_reward 0.219 ->
    0.969 at step 6 and at step 12; train reward 0.312, 0.469, 0.844 in steps 1-3 and 0.938, 1.0, 0.969
    in steps 10-12. Before sampling drew by inverse CDF: 0.281 -> 0.969, and 0.281,
    0.312, 0.812 against 0.969, 1.0, 0.969 (benchmarks/NOTES.md)."""
    rows = first_letter_run(tmp_path, {"path": str(real_model_dir)},
                            {"method": "grpo", "num_generations": 8, "max_new_tokens": 6, "temperature": 1.0,
                             "rewards": ["exact_match"]},
                            {"micro_batch_size": 4, "max_steps": 12, "learning_rate": 5e-4, "warmup_steps": 2,
                             "eval_every_steps": 6},
                            lora={"enabled": True, "r": 16, "alpha": 32, "target_modules": "all-linear"})
    evals = {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r}
    assert list(evals) == [0, 6, 12], evals
    assert 0.1 < evals[0] < 0.5, evals  # the base model is sometimes right: there is something to learn
    assert evals[12] > evals[0] + 0.34, evals  # half the rise measured (0.69 and 0.75)
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 12 and rows[1]["reward_std"] > 0, rewards
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards  # half the rise measured (0.43 and 0.51)


@pytest.mark.slow
def test_distillation_lowers_held_out_divergence_to_the_teacher(tmp_path, real_model_dir):
    """On-policy distillation (rl.method=distill, reverse KL) from SmolLM2-135M-Instruct, the teacher, into a small
    random student with its tokenizer (2 layers, hidden 64: 6.4M parameters, most of them the 49,152-row
    embeddings and output layer), full fine-tuning: each step the student answers 8 first-letter prompts and
    learns the teacher's distribution on its answers. The held-out divergence to the teacher (eval_loss, on the
    student's own sampled answers to 32 held-out prompts, the same seeds at every evaluation) falls. Measured
    2026-11-28 (2 shared CPU cores, one thread; 61 s): eval_loss 4.780 -> 3.875 at step 12 -> 3.736 at step 24."""
    from families import small_student

    student = small_student(real_model_dir, tmp_path / "student")
    rows = first_letter_run(tmp_path, {"path": str(student)},
                            {"method": "distill", "teacher": str(real_model_dir), "max_new_tokens": 8},
                            {"micro_batch_size": 8, "max_steps": 24, "learning_rate": 3e-3, "warmup_steps": 2,
                             "eval_every_steps": 12})
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    print(f"distillation from SmolLM2: eval_loss {evals}; train loss {[round(r['loss'], 3) for r in rows[1:]]}")
    assert list(evals) == [0, 12, 24], evals
    assert evals[12] < evals[0] and evals[24] < evals[0] - 0.5, evals  # half the fall measured (1.04)
