"""Groundwork of preference training (issue 29): each completion's summed log-probability through
the chunked output layer, and the DPO, IPO, SimPO and ORPO losses on hand-computed log-probabilities."""

import math

import pytest
import torch

from toolkit.objectives import preference_losses


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
