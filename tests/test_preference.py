"""Preference training without launching: each completion's summed log-probability through the
chunked output layer; the DPO, IPO, SimPO and ORPO losses on hand-computed log-probabilities;
preference pairs as data (formats, labels, truncation, the rule for rows without targets),
batches (padded and padding-free) and recipes (defaults and refusals); the objective against
hand-summed log-probabilities; the estimate of a preference run."""

import json
import math

import pytest
import torch

from toolkit.config import ConfigError, DataConfig, load_recipe
from toolkit.data.batching import Collator
from toolkit.data.formats import IGNORE
from toolkit.data.prepare import build_datasets
from toolkit.data.tokenize import MissingField, tokenize_examples
from toolkit.errors import ToolkitError
from toolkit.training.objectives import preference_losses

from families import family_tokenizer


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# Two pairs: summed log-probabilities of the chosen and rejected completions, their token counts,
# and the reference model's sums.
CHOSEN, REJECTED = [-4.0, -9.0], [-6.0, -7.5]
CHOSEN_N, REJECTED_N = [2, 3], [3, 5]
REF_CHOSEN, REF_REJECTED = [-5.0, -8.0], [-5.0, -8.0]


def losses(method, **kw):
    t = torch.tensor
    out = preference_losses(method, t(CHOSEN), t(REJECTED), t(CHOSEN_N), t(REJECTED_N), t(REF_CHOSEN),
                            t(REF_REJECTED), **kw)
    return [x.tolist() for x in out]


def test_dpo_sigmoid_and_its_label_smoothing():
    got, rewards_chosen, rewards_rejected = losses("dpo", beta=0.1)
    # pair 1: logits = (-4 + 5) - (-6 + 5) = 2, loss = -log sigma(0.2) = ln(1 + e^-0.2)
    assert got[0] == pytest.approx(0.598138869, abs=1e-7)
    for i in range(2):
        logits = (CHOSEN[i] - REF_CHOSEN[i]) - (REJECTED[i] - REF_REJECTED[i])
        assert got[i] == pytest.approx(-log_sigmoid(0.1 * logits), rel=1e-6)
        assert rewards_chosen[i] == pytest.approx(0.1 * (CHOSEN[i] - REF_CHOSEN[i]), rel=1e-6)
        assert rewards_rejected[i] == pytest.approx(0.1 * (REJECTED[i] - REF_REJECTED[i]), rel=1e-6)
    smooth, _, _ = losses("dpo", beta=0.5, label_smoothing=0.2)
    logits = 2.0
    assert smooth[0] == pytest.approx(-0.8 * log_sigmoid(0.5 * logits) - 0.2 * log_sigmoid(-0.5 * logits), rel=1e-6)


def test_ipo_on_per_token_averages():
    got, _, _ = losses("dpo", beta=0.1, loss_type="ipo")
    for i in range(2):
        logits = ((CHOSEN[i] - REF_CHOSEN[i]) / CHOSEN_N[i]) - ((REJECTED[i] - REF_REJECTED[i]) / REJECTED_N[i])
        assert got[i] == pytest.approx((logits - 1 / (2 * 0.1)) ** 2, rel=1e-6)
    # pair 1: (1/2 - (-1/3) - 5)^2 = (-25/6)^2
    assert got[0] == pytest.approx((25 / 6) ** 2, rel=1e-6)


def test_simpo_is_reference_free_on_averages_with_a_margin():
    got, rewards_chosen, rewards_rejected = losses("simpo", beta=2.0, gamma=0.5)
    for i in range(2):
        c, r = CHOSEN[i] / CHOSEN_N[i], REJECTED[i] / REJECTED_N[i]
        assert got[i] == pytest.approx(-log_sigmoid(2.0 * (c - r - 0.5 / 2.0)), rel=1e-6)
        assert rewards_chosen[i] == pytest.approx(2.0 * c) and rewards_rejected[i] == pytest.approx(2.0 * r)
    # pair 1: c = -2, r = -2, loss = -log sigma(2 * -0.25) = ln(1 + e^0.5)
    assert got[0] == pytest.approx(math.log1p(math.exp(0.5)), rel=1e-6)
    assert losses("simpo", beta=2.0, gamma=0.5)[0] == losses("simpo", beta=2.0, gamma=0.5)[0]  # no reference used


def test_orpo_is_the_chosen_nll_minus_the_weighted_log_odds_ratio():
    got, _, _ = losses("orpo", beta=0.1)
    for i in range(2):
        c, r = CHOSEN[i] / CHOSEN_N[i], REJECTED[i] / REJECTED_N[i]
        log_odds = (c - math.log1p(-math.exp(c))) - (r - math.log1p(-math.exp(r)))
        assert got[i] == pytest.approx(-c - 0.1 * log_sigmoid(log_odds), rel=1e-6)


def test_gradients_push_the_chosen_up_and_the_rejected_down():
    for method, kw in (("dpo", {}), ("simpo", {"gamma": 0.5}), ("orpo", {})):
        chosen = torch.tensor([-4.0], requires_grad=True)
        rejected = torch.tensor([-6.0], requires_grad=True)
        loss, _, _ = preference_losses(method, chosen, rejected, torch.tensor([2]), torch.tensor([3]),
                                       torch.tensor([-5.0]), torch.tensor([-5.0]), beta=0.1, **kw)
        loss.sum().backward()
        assert chosen.grad.item() < 0 < rejected.grad.item(), method


# ----------------------------------------------------------------------------- pairs: data, batches, config


@pytest.fixture(scope="module")
def tok():
    return family_tokenizer("llama3")


def tiny_model(chunk_tokens: int):
    """A one-layer Llama (vocabulary 50), seeded, with the chunked loss at `chunk_tokens` a chunk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.training.loss import use_token_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    use_token_loss(model, "chunked", chunk_tokens)
    return model


def trained(example, tokenizer) -> str:
    return tokenizer.decode([i for i, y in zip(example["input_ids"], example["labels"]) if y != IGNORE])


def test_text_pairs_train_on_the_completions_with_eos(tok):
    chosen, rejected = tokenize_examples({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, "preference",
                                         tok, 64, False)
    for example, answer in ((chosen, " 4"), (rejected, " 5")):
        assert example["input_ids"][0] == tok.bos_token_id  # as data.format=text adds it
        assert trained(example, tok) == answer + tok.eos_token
        assert tok.decode(example["input_ids"][1:]) == "Q: 2+2?\nA:" + answer + tok.eos_token
    assert chosen["input_ids"][:-3] == rejected["input_ids"][:-3]  # one prompt


def test_chat_pairs_train_on_what_the_template_adds_after_the_prompt(tok):
    prompt = [{"role": "user", "content": "2+2?"}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    chosen, rejected = tokenize_examples(row, "preference", tok, 256, False)
    assert trained(chosen, tok) == "4<|eot_id|>" and trained(rejected, tok) == "5<|eot_id|>"
    whole = tok.apply_chat_template(prompt + row["chosen"], tokenize=False)
    assert tok.decode(chosen["input_ids"]) == whole
    # TRL's implicit prompt: whole conversations that open alike
    implicit = {"chosen": prompt + row["chosen"], "rejected": prompt + row["rejected"]}
    assert tokenize_examples(implicit, "preference", tok, 256, False) == [chosen, rejected]
    # a prompt written as text is one user turn
    assert tokenize_examples({**row, "prompt": "2+2?"}, "preference", tok, 256, False) == [chosen, rejected]


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "q", "chosen": None, "rejected": "b"}, "chosen is null or missing"),
    ({"prompt": "q", "chosen": "a", "rejected": "  "}, "rejected is empty"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "chosen is identical to rejected"),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, "prompt is null or missing"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": [{"role": "assistant", "content": "b"}]},
     "chosen is empty"),
])
def test_pairs_that_cannot_train_fall_under_the_rule_for_empty_rows(tok, row, reason):
    with pytest.raises(MissingField, match=reason):
        tokenize_examples(row, "preference", tok, 64, False)


def test_a_pair_of_text_and_messages_is_refused(tok):
    with pytest.raises(ToolkitError, match="both be text or both be lists"):
        tokenize_examples({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
                          "preference", tok, 64, False)


def test_a_long_pair_keeps_its_prompt_and_cuts_its_completions(tok):
    row = {"prompt": "p" * 10, "chosen": "c" * 20, "rejected": "r" * 5}
    chosen, rejected = tokenize_examples(row, "preference", tok, 16, False)
    assert chosen["length"] == 16 and trained(chosen, tok) == "c" * 5  # BOS + 10 prompt bytes + 5 of 21
    assert trained(rejected, tok) == "r" * 5  # its eos cut: 1 + 10 + 5 = 16
    assert chosen["full_targets"] == 21
    short = tokenize_examples(row, "preference", tok, 11, False)
    assert all(e["n_targets"] == 0 for e in short)  # the prompt fills max_seq_len: nothing left to compare


def test_collated_pairs_put_the_chosen_rows_first_then_the_rejected(tok):
    examples = [{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3], "rejected_input_ids": [1, 2],
                 "rejected_labels": [IGNORE, 9], "reference": [-1.0, -2.0]},
                None]
    batch = Collator(0, pairs=True)(examples)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [0, 0, 0], [1, 2, 0], [0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3], [IGNORE] * 3, [IGNORE, 9, IGNORE], [IGNORE] * 3]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]]  # padding: 2 positions
    assert batch["reference_logps"].tolist() == [-1.0, 0.0, -2.0, 0.0]
    from toolkit.training.objectives import Preference

    assert Preference.valid(batch).tolist() == [True, False]  # eval padding is no pair
    only_padding = Collator(0, pairs=True)([None, None])  # a rank whose eval share ran out
    assert only_padding["input_ids"].shape == (4, 2) and Preference.valid(only_padding).tolist() == [False, False]


def test_the_objective_is_the_preference_loss_of_its_own_log_probabilities():
    """Preference.loss_sum on a tiny model equals preference_losses of the pairs' log-probabilities
    summed by hand from the model's own logits; a pair without targets adds nothing."""
    from toolkit.config import PreferenceConfig
    from toolkit.training.objectives import Preference

    model = tiny_model(3)
    ids = torch.randint(1, 50, (6, 7))
    labels = ids.clone()
    labels[:, :3] = IGNORE
    labels[2] = IGNORE  # the third pair's chosen: no targets
    reference = torch.randn(6)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "reference_logps": reference}
    objective = Preference(PreferenceConfig(method="dpo", beta=0.1))
    got = objective.loss_sum(model, batch)
    logits = model(input_ids=ids).logits[:, :-1].log_softmax(-1)
    picked = logits.gather(-1, ids[:, 1:, None])[..., 0]
    logps = (picked * (labels[:, 1:] != IGNORE)).sum(1)
    counts = (labels[:, 1:] != IGNORE).sum(1).clamp(min=1)
    want, _, _ = preference_losses("dpo", logps[:3], logps[3:], counts[:3], counts[3:], reference[:3], reference[3:],
                                   beta=0.1)
    torch.testing.assert_close(got, want[:2].sum(), rtol=1e-5, atol=1e-6)
    assert objective.units(batch) == 2
    metrics = objective.step_metrics("cpu")
    assert set(metrics) == {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"}
    torch.testing.assert_close(metrics["reward_margin"], metrics["rewards_chosen"] - metrics["rewards_rejected"])


def test_padding_free_pairs_give_the_padded_pairs_loss_and_metrics():
    """The same pairs collated padded (2 x batch rows) and padding-free (one row of 2 x batch
    documents): the objective's loss sum, units and metrics agree within 1e-5 (eval padding included)."""
    from toolkit.config import PreferenceConfig
    from toolkit.training.objectives import Preference

    model = tiny_model(4)
    g = torch.Generator().manual_seed(3)

    def sequence(n, prompt):
        ids = torch.randint(1, 50, (n,), generator=g)
        labels = ids.clone()
        labels[:prompt] = IGNORE
        return ids.numpy(), labels.numpy()

    examples = []
    for n_c, n_r in ((9, 5), (4, 12), (7, 7)):
        (c, cl), (r, rl) = sequence(n_c, 3), sequence(n_r, 3)
        examples.append({"input_ids": c, "labels": cl, "rejected_input_ids": r, "rejected_labels": rl,
                         "reference": [-3.0, -4.0]})
    examples.append(None)
    results = []
    for padding_free in (False, True):
        batch = Collator(0, padding_free=padding_free, pairs=True)(examples)
        assert ("attention_mask" in batch) != padding_free
        objective = Preference(PreferenceConfig(method="dpo", beta=0.1))
        loss = objective.loss_sum(model, batch)
        results.append((loss, objective.units(batch), objective.step_metrics("cpu")))
    (a, units_a, ma), (b, units_b, mb) = results
    assert units_a == units_b == 3
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=1e-5, atol=1e-6, msg=k)


def test_the_rule_for_empty_rows_drops_a_few_bad_pairs_and_refuses_many(tmp_path, tok):
    good = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(199)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + [{"prompt": "q", "chosen": "x", "rejected": "x"}]))
    data = build_datasets(DataConfig(train_files=[str(path)], format="preference", max_seq_len=32), tok, 0, False)
    assert len(data.train) == 199 and data.train.pairs
    assert any("row 200: no target tokens left (chosen is identical to rejected); dropped 1" in w
               for w in data.warnings)
    path.write_text("".join(json.dumps(r) + "\n"
                            for r in good[:50] + [{"prompt": "q", "chosen": "", "rejected": "x"}] * 2))
    with pytest.raises(ToolkitError, match="row 51: no target tokens left \\(chosen is empty\\); 2 of 52 rows"):
        build_datasets(DataConfig(train_files=[str(path)], format="preference", max_seq_len=32), tok, 0, False)


def test_pairs_that_are_the_same_once_cut_are_said_with_the_truncated_count(tmp_path, tok):
    """Before issue 69 a pair whose completions differ only past data.max_seq_len trained as two equal
    sequences (no gradient in DPO's loss) without a word: a warning names the first and counts them,
    beside the data line of truncated pairs; dropped pairs (data.overlong=drop) are not said twice."""
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(6)]
    rows[2] = {"prompt": "q", "chosen": "a" * 40 + "x", "rejected": "a" * 40 + "y"}  # differ past 32 tokens
    rows[4] = {"prompt": "q", "chosen": "x" * 40, "rejected": "y" * 40}  # cut, but still different
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_datasets(DataConfig(train_files=[str(path)], format="preference", max_seq_len=32), tok, 0, False)
    assert len(data.train) == 6 and any(line.startswith("2 of 6 pairs truncated") for line in data.lines), data.lines
    assert [w for w in data.warnings if "same once cut" in w] == [
        f"{path}: row 3: chosen and rejected are the same once cut to data.max_seq_len=32 (they differ only past "
        "it), so the pair teaches nothing (ORPO: only the chosen answer's NLL); 1 such pair(s) of 6: raise "
        "data.max_seq_len, or set data.overlong=drop"]
    dropped = build_datasets(DataConfig(train_files=[str(path)], format="preference", max_seq_len=32,
                                        overlong="drop"), tok, 0, False)
    assert len(dropped.train) == 4 and not [w for w in dropped.warnings if "same once cut" in w]


def recipe_file(tmp_path, **sections):
    import yaml

    body = {"output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-llama"},
            "data": {"train_files": ["x.jsonl"], "format": "preference"}, "preference": {"method": "dpo"}}
    for key, value in sections.items():
        section, _, name = key.partition("__")
        body.setdefault(section, {})[name] = value
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


@pytest.mark.parametrize("overrides, key, words", [
    ({"data__format": "messages"}, "data.format", "must be preference"),
    ({"preference__method": None}, "data.format", "only with a preference.method"),
    ({"preference__gamma": 1.0}, "preference.gamma", "SimPO setting"),
    ({"preference__method": "orpo", "preference__loss_type": "ipo"}, "preference.loss_type", "a DPO or KTO setting"),
    ({"preference__reference": "adapter"}, "preference.reference", "lora.enabled"),
    ({"preference__method": "simpo", "preference__reference": "precomputed"}, "preference.reference", "no reference"),
    ({"preference__beta": 0}, "preference.beta", "positive"),
    ({"preference__label_smoothing": 0.5}, "preference.label_smoothing", "[0, 0.5)"),
    ({"data__packing": True}, "data.packing", "not packed"),
    ({"data__train_on_prompt": True}, "data.train_on_prompt", "completions only"),
    ({"preference__bta": 1}, "preference.bta", "did you mean beta"),
])
def test_contradicting_preference_keys_are_refused_naming_the_key(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe_file(tmp_path, **overrides))
    assert e.value.key == key and words in str(e.value), str(e.value)


def test_preference_defaults_follow_the_method(tmp_path):
    dpo = load_recipe(recipe_file(tmp_path)).preference
    assert (dpo.beta, dpo.reference, dpo.gamma) == (0.1, "precomputed", None)
    lora = load_recipe(recipe_file(tmp_path, lora__enabled=True)).preference
    assert lora.reference == "adapter"
    simpo = load_recipe(recipe_file(tmp_path, preference__method="simpo")).preference
    assert (simpo.beta, simpo.gamma) == (2.0, 0.5)
    plain = load_recipe(recipe_file(tmp_path, data__format="alpaca", preference__method=None))
    assert plain.preference.method is None


@pytest.mark.parametrize("row, fmt", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
      "rejected": [{"role": "assistant", "content": "c"}]}, "preference"),
])
def test_chat_rows_without_a_chat_template_are_refused_in_one_line(row, fmt):
    """Was a ValueError from transformers (a traceback) for a tokenizer without a template."""
    tokenizer = family_tokenizer("llama3")
    tokenizer.chat_template = None
    with pytest.raises(ToolkitError, match="this tokenizer has none"):
        tokenize_examples(row, fmt, tokenizer, 64, False)


def test_a_pair_without_targets_gives_no_nan_under_orpo():
    """ORPO's log(1 - p) of a completion with no targets (log-probability 0) is -inf: its pair is
    masked out of the loss, and the NaN gradient of that term stays on the side that has no tokens
    to pass it to, so nothing reaches the weights."""
    from toolkit.config import PreferenceConfig
    from toolkit.training.objectives import Preference

    model = tiny_model(4)
    ids = torch.randint(1, 50, (4, 6))
    labels = ids.clone()
    labels[:, :2] = IGNORE
    labels[3] = IGNORE  # the second pair: its rejected completion has no targets, its chosen has
    loss = Preference(PreferenceConfig(method="orpo", beta=0.1)).loss_sum(
        model, {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_estimate_counts_both_sequences_of_a_pair_and_the_reference_forward(tmp_path):
    """Memory: a micro-batch of pairs is twice as many sequences in one forward. FLOPs: DPO's
    reference through the disabled adapter is one more forward (2 per weight) per token."""
    from toolkit.backends.model_counts import count_model, read_config
    from toolkit.backends.run_sizing import setup_from_recipe
    from toolkit.backends.sizing import BY_NAME, estimate
    from toolkit.observe.measure import Flops

    recipe = load_recipe(recipe_file(tmp_path, lora__enabled=True, train__micro_batch_size=4))
    pairs = setup_from_recipe(recipe)
    plain = setup_from_recipe(load_recipe(recipe_file(tmp_path, lora__enabled=True, train__micro_batch_size=4,
                                                      data__format="alpaca", preference__method=None)))
    assert (pairs.micro_batch, plain.micro_batch) == (8, 4) and "8 sequences (4 preference pairs)" in pairs.batch_text()
    ddp = BY_NAME["DDP"]
    assert estimate(ddp, pairs).gpu["activations"] == pytest.approx(2 * estimate(ddp, plain).gpu["activations"])
    counts = count_model(read_config("tiny-llama"), "tiny-llama", recipe.lora)
    with_reference, without = Flops.of(counts, True, extra_forwards=1), Flops.of(counts, True)
    assert with_reference.dense == without.dense + 2 * counts.matmul
    assert with_reference.attention == pytest.approx(without.attention * 8 / 6)


def test_the_label_audit_of_a_pair_shows_both_completions(tok):
    from toolkit.data.prepare import label_audit

    chosen, rejected = tokenize_examples({"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}, "preference",
                                         tok, 64, False)
    line = label_audit({**chosen, "rejected_input_ids": rejected["input_ids"], "rejected_labels": rejected["labels"]},
                       tok)
    assert line.startswith("first training pair, chosen, trained tokens in [[ ]] (3 of ")
    assert line.endswith(f"Q: 2+2?\\nA:[[ 4{tok.eos_token}]] | rejected: [[ 5{tok.eos_token}]]"), line
