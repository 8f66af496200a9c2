"""TRL 1.16's DPO loss types and SFT's DFT loss, against TRL's own code: each of DPOConfig's loss types
(and loss_weights combining several, TRL's MPO) through DPOTrainer._compute_loss, and SFTConfig's
loss_type=dft through SFTTrainer.compute_loss, run on the same log-probabilities (a stand-in model that
returns them) as ours: the same loss and the same gradient within 1e-5. The recipe keys' refusals."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from toolkit.config import ConfigError, load_recipe
from toolkit.config.objectives import DPO_LOSS_TYPES
from toolkit.data.formats import IGNORE
from toolkit.training.objectives import preference_losses

trl = pytest.importorskip("trl")

N, T = 4, 7  # pairs; positions of a sequence (its first is the prompt's)


def accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x,
                           parallelism_config=None, num_processes=1)


def stand_in(outputs):
    """A model that returns `outputs` (TRL's fused-head outputs) whatever it is given."""
    return lambda **kwargs: outputs


def pairs(seed: int = 0, dtype=torch.float64):
    """(raw per-token log-probabilities (2N, T-1), leaf; completion mask (2N, T); reference sums (2N)). The
    chosen completions (rows 0..N-1) are equally long, the rejected ones 1 to 4 tokens."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * N, T, dtype=torch.long)
    mask[:N, 3:] = 1
    for i, length in enumerate((1, 4, 2, 3)):
        mask[N + i, T - length:] = 1
    raw = (-3 * torch.rand(2 * N, T - 1, generator=g, dtype=dtype)).requires_grad_()
    reference = (raw.detach() * mask[:, 1:]).sum(1) + torch.randn(2 * N, generator=g, dtype=dtype)
    return raw, mask, reference


def trl_dpo(loss_type, raw, mask, reference, *, beta=0.1, loss_weights=None, label_smoothing=0.0,
            discopop_tau=0.05, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5):
    """TRL 1.16's DPOTrainer._compute_loss on these log-probabilities (precomputed reference, no ld_alpha, no WPO
    weighting: DPOConfig's defaults)."""
    from trl import DPOTrainer

    trainer = object.__new__(DPOTrainer)
    names = [loss_type] if isinstance(loss_type, str) else loss_type
    trainer.__dict__.update(
        model=SimpleNamespace(training=True), accelerator=accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef, loss_types=names,
        loss_weights=loss_weights or [1.0] * len(names), beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, args=SimpleNamespace(discopop_tau=discopop_tau), _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    shape, n = raw.shape, len(mask) // 2
    outputs = SimpleNamespace(log_probs=raw * mask[:, 1:].to(raw.dtype), entropy=torch.zeros(shape),
                              mean_logits=torch.zeros(shape), is_top1=torch.zeros(shape, dtype=torch.bool))
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": reference[:n], "ref_rejected_logps": reference[n:]}
    return trainer._compute_loss(stand_in(outputs), inputs, return_outputs=False)


def ours(loss_type, raw, mask, reference, *, beta=0.1, valid=None, **kw):
    """Our per-pair DPO losses of the same log-probabilities, averaged over the (valid) pairs."""
    logps, counts = (raw * mask[:, 1:]).sum(1), mask[:, 1:].sum(1).clamp(min=1).to(raw.dtype)
    n = len(logps) // 2
    losses, _, _ = preference_losses("dpo", logps[:n], logps[n:], counts[:n], counts[n:], reference[:n],
                                     reference[n:], beta=beta, loss_type=loss_type, valid=valid, **kw)
    return losses.mean() if valid is None else losses[valid].mean()


def assert_same_loss_and_gradient(mine, theirs, raw):
    (g_mine,) = torch.autograd.grad(mine, raw)
    (g_theirs,) = torch.autograd.grad(theirs, raw)
    torch.testing.assert_close(mine.double(), theirs.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_mine, g_theirs, rtol=1e-5, atol=1e-5)
    assert g_mine.abs().sum() > 0


def smoothing(loss_type: str) -> float:
    return 0.1 if loss_type in ("robust", "exo_pair", "aot", "aot_unpaired") else 0.0


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_each_dpo_loss_type_equals_trls(loss_type):
    """Every name TRL 1.16's DPOConfig takes; robust, exo_pair and the aot pair with label_smoothing 0.1 (TRL 1.16's
    sigmoid has none: ours, conservative DPO, is compared at 0 and below)."""
    raw, mask, reference = pairs()
    eps = smoothing(loss_type)
    for beta in (0.1, 0.5):
        kw = {"beta": beta, "label_smoothing": eps, "discopop_tau": 0.3 if loss_type == "discopop" else 0.05}
        assert_same_loss_and_gradient(ours(loss_type, raw, mask, reference, **kw),
                                      trl_dpo(loss_type, raw, mask, reference, **kw), raw)


def test_loss_weights_combine_loss_types_as_trls_mpo():
    raw, mask, reference = pairs(1)
    kw = {"beta": 0.2, "loss_weights": [0.8, 0.2, 1.0]}
    assert_same_loss_and_gradient(ours(["sigmoid", "bco_pair", "sft"], raw, mask, reference, **kw),
                                  trl_dpo(["sigmoid", "bco_pair", "sft"], raw, mask, reference, **kw), raw)
    kw = {"beta": 0.1, "label_smoothing": 0.05}  # no weights: 1.0 each
    assert_same_loss_and_gradient(ours(["robust", "apo_zero", "aot"], raw, mask, reference, **kw),
                                  trl_dpo(["robust", "apo_zero", "aot"], raw, mask, reference, **kw), raw)


@pytest.mark.parametrize("f_divergence_type", ["forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop",
                                       "sft"])
def test_f_divergences_equal_trls(loss_type, f_divergence_type):
    """f-DPO (TRL's f_divergence_type, f_alpha_divergence_coef) on the loss types TRL defines it for, in float32
    (TRL's alpha_divergence clamps per dtype and knows no float64)."""
    raw, mask, reference = pairs(4, torch.float32)
    kw = {"beta": 0.3, "label_smoothing": smoothing(loss_type) or (0.1 if loss_type == "exo_pair" else 0.0),
          "f_divergence_type": f_divergence_type, "f_alpha_divergence_coef": 0.3}
    assert_same_loss_and_gradient(ours(loss_type, raw, mask, reference, **kw),
                                  trl_dpo(loss_type, raw, mask, reference, **kw), raw)


def test_conservative_dpo_keeps_its_label_smoothing():
    """sigmoid with label_smoothing: -(1 - ε) log σ(βd) - ε log σ(-βd), as before TRL 1.x's rewrite (TRL 1.16's
    sigmoid ignores label_smoothing; this toolkit's has applied it since its DPO)."""
    raw, mask, reference = pairs(2)
    logps = (raw * mask[:, 1:]).sum(1)
    d = (logps[:N] - reference[:N]) - (logps[N:] - reference[N:])
    logsigmoid = torch.nn.functional.logsigmoid
    want = (-0.8 * logsigmoid(0.1 * d) - 0.2 * logsigmoid(-0.1 * d)).mean()
    torch.testing.assert_close(ours("sigmoid", raw, mask, reference, label_smoothing=0.2), want)


def test_aot_sorts_among_the_valid_pairs_only():
    """A pair without targets (eval padding) takes no place in aot's sort: the loss of the batch with it equals
    TRL's on the batch without it."""
    raw, mask, reference = pairs(3)
    keep = torch.tensor([0, 1, 3, 4, 5, 7])  # pairs 0, 1, 3 of 4
    for loss_type in ("aot", "aot_unpaired"):
        valid = torch.tensor([True, True, False, True])
        mine = ours(loss_type, raw, mask, reference, valid=valid, label_smoothing=0.1)
        theirs = trl_dpo(loss_type, raw[keep], mask[keep], reference[keep], label_smoothing=0.1)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_sft_averages_each_pairs_own_tokens():
    """TRL's sft term averages over the batch's chosen tokens; ours over each pair's own (as ORPO's NLL here), so
    a pair weighs the same whatever the micro-batch: equal where the chosen completions are equally long (above),
    the mean of the pairs' own averages otherwise."""
    raw, mask, reference = pairs()
    mask[0, 3] = 0  # the first chosen completion one token shorter
    per_token = raw * mask[:, 1:]
    want = torch.stack([-per_token[i].sum() / mask[i, 1:].sum() for i in range(N)]).mean()
    torch.testing.assert_close(ours("sft", raw, mask, reference), want)


# ------------------------------------------------------------------ SFT's loss_type=dft


def trl_sft_dft(logits, labels):
    """TRL 1.16's SFTTrainer.compute_loss with loss_type=dft on the log-probabilities of `logits`."""
    from trl import SFTTrainer

    trainer = object.__new__(SFTTrainer)
    trainer.__dict__.update(
        model=SimpleNamespace(training=True), accelerator=accelerator(), aux_loss_enabled=False,
        compute_loss_func=None, label_smoother=None, _metrics={"train": defaultdict(list)},
        args=SimpleNamespace(loss_type="dft", average_tokens_across_devices=False),
        _total_train_tokens=0, _tp_size=1)
    targets = labels[:, 1:]
    kept = targets != IGNORE
    logps = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0] * kept
    outputs = SimpleNamespace(log_probs=logps, label_mask=kept, entropy=torch.zeros(logps.shape),
                              is_top1=torch.zeros(logps.shape, dtype=torch.bool))
    inputs = {"input_ids": torch.ones_like(labels), "attention_mask": torch.ones_like(labels), "labels": labels}
    return trainer.compute_loss(stand_in(outputs), inputs)


def test_dft_equals_trls_on_the_full_and_the_chunked_loss():
    """Our DFT loss (train.loss=full's full_loss_sum, and train.loss=chunked's through a tiny model's chunked
    output layer) over the target count equals TRL's SFT loss_type=dft on the same logits, value and gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.training.loss import full_loss_sum, token_loss_sum, use_token_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 40, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 40, (3, 9), generator=g)
    labels[:, :4] = IGNORE
    labels[1, 6:] = IGNORE
    count = int((labels[:, 1:] != IGNORE).sum())
    assert_same_loss_and_gradient(full_loss_sum(logits, labels, dft=True) / count, trl_sft_dft(logits, labels),
                                  logits)
    assert not torch.isclose(full_loss_sum(logits, labels, dft=True), full_loss_sum(logits, labels))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    use_token_loss(model, "chunked", 3)
    ids = torch.randint(1, 50, (3, 9), generator=g)
    labels = ids.clone()
    labels[:, :4] = IGNORE
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    chunked = token_loss_sum(model, batch, dft=True) / int((labels[:, 1:] != IGNORE).sum())
    (g_chunked,) = torch.autograd.grad(chunked, model.lm_head.weight)
    full = trl_sft_dft(model(input_ids=ids).logits, labels)
    (g_full,) = torch.autograd.grad(full, model.lm_head.weight)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_chunked, g_full, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ recipe keys


def recipe(tmp_path, preference=None, train=None, data_format="preference"):
    import yaml

    body = {"output_dir": str(tmp_path / "run"), "model": {"preset": "tiny-llama"},
            "data": {"train_files": ["x.jsonl"], "format": data_format}}
    if preference is not None:
        body["preference"] = preference
    if train is not None:
        body["train"] = train
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_the_new_keys_load_with_trls_defaults(tmp_path):
    mpo = load_recipe(recipe(tmp_path, {"method": "dpo", "loss_type": ["sigmoid", "bco_pair", "sft"],
                                        "loss_weights": [0.8, 0.2, 1]})).preference
    assert (mpo.loss_type, mpo.loss_weights, mpo.discopop_tau) == (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0],
                                                                   0.05)
    assert load_recipe(recipe(tmp_path, {"method": "dpo", "loss_type": "discopop", "discopop_tau": 0.1})) \
        .preference.discopop_tau == 0.1
    sft = load_recipe(recipe(tmp_path, train={"loss_type": "dft"}, data_format="alpaca"))
    assert sft.train.loss_type == "dft" and load_recipe(recipe(tmp_path, data_format="alpaca")).train.loss_type == "nll"


@pytest.mark.parametrize("preference, train, fmt, key, words", [
    ({"method": "dpo", "loss_type": "sigmoidd"}, None, "preference", "preference.loss_type",
     "preference.method=dpo takes sigmoid, hinge, ipo"),
    ({"method": "dpo", "loss_type": ["sigmoid", "nope"]}, None, "preference", "preference.loss_type", "got nope"),
    ({"method": "dpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, None, "preference",
     "preference.loss_weights", "one weight per preference.loss_type name: 2 name(s) (sigmoid, sft), got 1"),
    ({"method": "dpo", "loss_weights": [1.0, 2.0]}, None, "preference", "preference.loss_weights", "got 2 weight"),
    ({"method": "dpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, -0.5]}, None, "preference",
     "preference.loss_weights", "a negative weight makes the run maximise that loss"),
    ({"method": "dpo", "loss_type": ["sigmoid", "sft"], "loss_weights": [0, 0]}, None, "preference",
     "preference.loss_weights", "at least one above 0"),
    ({"method": "dpo", "loss_type": []}, None, "preference", "preference.loss_type", "one name, or for dpo a list"),
    ({"method": "dpo", "loss_type": ["sigmoid", "sigmoid"]}, None, "preference", "preference.loss_type", "twice"),
    ({"method": "kto", "loss_type": ["kto"]}, None, "unpaired", "preference.loss_type", "one name"),
    ({"method": "orpo", "loss_weights": [1.0]}, None, "preference", "preference.loss_weights", "a DPO setting"),
    ({"method": "dpo", "loss_type": "exo_pair"}, None, "preference", "preference.label_smoothing",
     "exo_pair needs it above 0"),
    ({"method": "dpo", "loss_type": "hinge", "label_smoothing": 0.1}, None, "preference",
     "preference.label_smoothing", "applies to dpo with loss_type sigmoid, robust"),
    ({"method": "dpo", "discopop_tau": 0.1}, None, "preference", "preference.discopop_tau", "discopop only"),
    ({"method": "dpo", "loss_type": ["sigmoid", "bco_pair"], "f_divergence_type": "forward_kl"}, None, "preference",
     "preference.f_divergence_type", "not bco_pair"),
    ({"method": "dpo", "f_alpha_divergence_coef": 0.3}, None, "preference", "preference.f_alpha_divergence_coef",
     "alpha_divergence only"),
    ({"method": "simpo", "f_divergence_type": "js_divergence"}, None, "preference", "preference.f_divergence_type",
     "a DPO setting"),
    ({"method": "dpo", "loss_type": "discopop", "discopop_tau": 0}, None, "preference", "preference.discopop_tau",
     "must be positive"),
    ({"method": "dpo"}, {"loss_type": "dft"}, "preference", "train.loss_type",
     "dft is supervised fine-tuning's loss; preference.method=dpo has its own"),
    (None, {"loss_type": "dfts"}, "alpaca", "train.loss_type", "must be one of nll, dft"),
])
def test_bad_loss_keys_are_refused_in_one_line_naming_the_key(tmp_path, preference, train, fmt, key, words):
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe(tmp_path, preference, train, fmt))
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value), str(e.value)
