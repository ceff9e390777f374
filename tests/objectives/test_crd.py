"""CRD's centred reward distillation: invariant to each prompt's reward offset (log Z cancels), zero at the
optimum, and it raises the implicit reward of samples better than their group."""

import torch

from gyremedia.objectives.crd import crd_loss


def test_a_per_prompt_shift_of_the_rewards_leaves_the_loss_unchanged():
    g = torch.Generator().manual_seed(0)
    implicit, signal = torch.randn(8, generator=g), torch.rand(8, generator=g)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    shifted = signal + torch.where(groups == 0, 0.3, -0.2)  # a constant per prompt: its own log Z
    torch.testing.assert_close(
        crd_loss(implicit, signal, groups, 2.0, 5.0), crd_loss(implicit, shifted, groups, 2.0, 5.0)
    )


def test_zero_when_the_centred_implicit_reward_matches_the_centred_reward():
    signal, groups = torch.tensor([0.9, 0.1, 0.5, 0.3]), torch.tensor([0, 0, 1, 1])
    beta = 4.0
    implicit = (signal - torch.tensor([0.5, 0.5, 0.4, 0.4])) / beta + torch.tensor([7.0, 7.0, -3.0, -3.0])
    torch.testing.assert_close(crd_loss(implicit, signal, groups, beta, 5.0), torch.zeros(4))


def test_it_raises_the_implicit_reward_of_the_better_sample():
    implicit = torch.zeros(4, requires_grad=True)
    loss = crd_loss(implicit, torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]), 1.0, 5.0).sum()
    (grad,) = torch.autograd.grad(loss, implicit)
    assert grad[0] < 0 < grad[1] and grad[2] == grad[3] == 0  # descent raises the better one; a tie stays
