"""GIPO's Gaussian trust weight: the unclipped ratio loss as its width grows, damped but never zero gradients."""

import torch

from gyremedia.objectives.clipped_ratio import clipped_ratio_loss
from gyremedia.objectives.gipo import gaussian_trust_loss


def test_the_weight_tends_to_the_unclipped_ratio_as_its_width_grows():
    log_ratio = torch.tensor([-0.3, -1e-3, 0.0, 2e-3, 0.5], requires_grad=True)
    advantages = torch.tensor([1.0, -2.0, 0.5, 1.5, -1.0])
    unclipped = -torch.exp(log_ratio) * advantages
    (expected,) = torch.autograd.grad(unclipped.sum(), log_ratio)
    for width, tolerance in ((1.0, 0.2), (1e3, 1e-6)):
        loss, _, weight = gaussian_trust_loss(log_ratio, advantages, width)
        (grad,) = torch.autograd.grad(loss.sum(), log_ratio)
        assert (weight <= 1).all()
        torch.testing.assert_close(grad, expected, atol=tolerance, rtol=0)


def test_extreme_ratios_are_damped_smoothly_and_never_lose_their_gradient():
    log_ratio = torch.tensor([0.0, 1e-4, 1e-3, 5e-3], requires_grad=True)
    advantages = torch.ones(4)
    loss, _, weight = gaussian_trust_loss(log_ratio, advantages, sigma=2e-3)
    (grad,) = torch.autograd.grad(loss.sum(), log_ratio)
    assert weight[0] == 1 and (weight.diff() < 0).all()  # the further from the old policy, the less it counts
    assert (grad != 0).all()  # never exactly zero...
    clipped_loss, _ = clipped_ratio_loss(log_ratio, advantages, 1e-3, 1e-3)
    (clipped_grad,) = torch.autograd.grad(clipped_loss.sum(), log_ratio)
    assert clipped_grad[-1] == 0  # ...where PPO's clip zeroes it
