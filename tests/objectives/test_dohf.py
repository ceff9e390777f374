"""DOHF's optimality weights and tilted-velocity target: flow matching when every sample is as good."""

import torch

from gyremedia.objectives.dohf import dohf_loss, optimality_weights


def test_weights_average_one_in_every_group_and_follow_the_advantage():
    advantages = torch.tensor([1.0, -1.0, 0.0, 2.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    weights = optimality_weights(advantages, groups, temperature=1.0)
    torch.testing.assert_close(weights[:3].mean(), torch.tensor(1.0))
    torch.testing.assert_close(weights[3:].mean(), torch.tensor(1.0))
    assert weights[0] > weights[2] > weights[1] and weights[3] > weights[4] == weights[5]
    flat = optimality_weights(advantages, groups, temperature=1e6)  # tau -> inf: no tilt
    torch.testing.assert_close(flat, torch.ones(6))


def test_equal_weights_ask_for_no_change_and_others_pull_toward_or_away_from_the_target():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 2, 4, generator=g, requires_grad=True)
    target = torch.randn(3, 2, 4, generator=g)
    (grad,) = torch.autograd.grad(dohf_loss(v, v.detach(), target, torch.ones(3)).sum(), v)
    assert grad.abs().max() == 0  # no sample better than another: the model stays where it is
    (fm,) = torch.autograd.grad((v - target).pow(2).mean(dim=(1, 2)).sum(), v)
    (weighted,) = torch.autograd.grad(dohf_loss(v, v.detach(), target, torch.tensor([2.0, 1.0, 0.0])).sum(), v)
    # better than the group: along its flow-matching gradient (toward its sample); worse: against it
    torch.testing.assert_close(weighted, fm * torch.tensor([1.0, 0.0, -1.0]).view(3, 1, 1))
