"""Token GRPO's pieces against their definitions, by hand: the clipped surrogate, the loss aggregations,
the importance corrections (TIS, MIS, CIS) and the k3 KL."""

from __future__ import annotations

import math

import pytest
import torch

from gyremedia.objectives.clipped_ratio import clipped_ratio_loss
from gyremedia.objectives.token_grpo import aggregate_tokens, importance_weights
from gyremedia_regularizers.token import k3


def test_the_clipped_surrogate_is_ppos_with_clip_higher():
    log_ratio = torch.log(torch.tensor([0.5, 1.0, 1.5, 1.5]))
    advantages = torch.tensor([1.0, 2.0, 1.0, -1.0])
    loss, ratio = clipped_ratio_loss(log_ratio, advantages, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(ratio, torch.tensor([0.5, 1.0, 1.5, 1.5]))
    # A > 0: min(r A, clip(r) A); A < 0: the larger of the two losses
    torch.testing.assert_close(loss, torch.tensor([-0.5, -2.0, -1.28, 1.5]))


def test_aggregations_follow_their_definitions():
    values = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert aggregate_tokens(values, mask, "grpo", max_length=4).item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate_tokens(values, mask, "bnpo", max_length=4).item() == pytest.approx(10.0 / 4)
    assert aggregate_tokens(values, mask, "dr_grpo", max_length=8).item() == pytest.approx(10.0 / (2 * 8))
    assert aggregate_tokens(values, mask, "dapo", max_length=4, normaliser=5.0).item() == pytest.approx(10.0 / 5)


def test_importance_weights():
    sampler = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    trainer = torch.log(torch.tensor([[0.6, 0.99, 0.5]]))  # ratios 1.2, 1.1, 5.0
    torch.testing.assert_close(
        importance_weights(trainer, sampler, "tis", cap=2.0, threshold=1.0), torch.tensor([[1.2, 1.1, 2.0]])
    )
    torch.testing.assert_close(
        importance_weights(trainer, sampler, "mis", cap=2.0, threshold=1.0), torch.tensor([[1.2, 1.1, 0.0]])
    )
    # CIS: the trainer's log-odds may exceed the sampler's by at most delta; the implied cap on the weight
    # sigmoid(logit(q) + delta) / q tightens as the sampler's confidence q rises, and small weights stay
    cis = importance_weights(trainer, sampler, "cis", cap=2.0, threshold=1.0)[0]
    q, delta = torch.tensor([0.5, 0.9, 0.1]), 1.0
    caps = torch.sigmoid(torch.logit(q) + delta) / q
    assert caps[1] < caps[0] < caps[2]
    expected = torch.minimum(torch.tensor([1.2, 1.1, 5.0]), caps)
    torch.testing.assert_close(cis, expected.float(), rtol=1e-5, atol=1e-6)
    lower = importance_weights(
        torch.log(torch.tensor([[0.2]])), torch.log(torch.tensor([[0.5]])), "cis", cap=2.0, threshold=1.0
    )
    assert lower.item() == pytest.approx(0.4)  # never clipped upward


def test_k3_is_zero_at_the_reference_and_positive_elsewhere():
    log_probs = torch.log(torch.tensor([0.3, 0.5]))
    assert torch.equal(k3(log_probs, log_probs), torch.zeros(2))
    away = k3(log_probs, torch.log(torch.tensor([0.6, 0.25])))
    d = math.log(0.6 / 0.3)
    assert away[0].item() == pytest.approx(math.exp(d) - d - 1) and (away > 0).all()


def test_sequence_level_ratios_are_gspos():
    """GSPO: every token carries exp(mean log ratio) of its sequence (masked tokens left out), and with the grpo
    aggregation the gradient is s_b A_b (1/|y_b|) sum_t grad log pi(y_bt)."""
    from gyremedia.objectives.token_grpo import log_ratios

    old = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    log_probs = (old + torch.tensor([[0.1, -0.3, 0.0], [0.2, 0.0, 5.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ratios = log_ratios(log_probs, old, mask, "sequence")
    torch.testing.assert_close(ratios, torch.tensor([[-0.2 / 3] * 3, [0.1] * 3]))
    advantages = torch.tensor([[1.0], [-2.0]])
    loss, ratio = clipped_ratio_loss(ratios, advantages, eps_low=0.5, eps_high=0.5)  # nothing clipped
    aggregate_tokens(loss, mask, "grpo", max_length=3).backward()
    s = ratio[:, 0].detach()
    expected = -(s * advantages[:, 0])[:, None] * mask / mask.sum(-1, keepdim=True) / 2  # batch mean of 2
    torch.testing.assert_close(log_probs.grad, expected)
    # token level: each token's own ratio
    torch.testing.assert_close(log_ratios(log_probs, old, mask, "token"), (log_probs - old).detach())


def test_log_ratios_and_k3_are_bounded_as_verl_bounds_them():
    from gyremedia.objectives.token_grpo import log_ratios

    far = torch.tensor([[-100.0, 0.5, 100.0]])
    assert log_ratios(far, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), "token").tolist() == [
        [-20.0, 0.5, 20.0]
    ]
    assert k3(torch.zeros(3), torch.tensor([-100.0, 0.1, 100.0])).tolist() == pytest.approx(
        [10.0, math.exp(0.1) - 1.1, 10.0], rel=1e-5
    )  # 19 + exp(-20) and exp(20) - 21, each held to 10
