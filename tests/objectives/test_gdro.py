"""GDRO's listwise loss: Diffusion-DPO for two samples and a sharp temperature, blind to a group's log Z."""

import torch

from gyremedia.objectives.gdro import plackett_luce_loss


def test_two_samples_at_a_sharp_temperature_is_the_dpo_logistic_loss():
    scores = torch.tensor([[0.3, -0.4], [1.0, 2.0]])
    rewards = torch.tensor([[0.2, 0.9], [0.7, 0.1]])  # the winner: second, then first
    winner, loser = torch.tensor([-0.4, 1.0]), torch.tensor([0.3, 2.0])
    expected = -torch.nn.functional.logsigmoid(winner - loser)
    torch.testing.assert_close(plackett_luce_loss(scores, rewards, temperature=1e-4), expected)


def test_adding_a_constant_to_a_groups_scores_changes_nothing():
    g = torch.Generator().manual_seed(0)
    scores, rewards = torch.randn(3, 6, generator=g), torch.rand(3, 6, generator=g)
    shifted = scores + torch.tensor([[5.0], [-2.0], [0.0]])  # each prompt's own log Z
    torch.testing.assert_close(plackett_luce_loss(scores, rewards, 0.05), plackett_luce_loss(shifted, rewards, 0.05))


def test_descent_ranks_the_scores_like_the_rewards():
    scores = torch.zeros(1, 4, requires_grad=True)
    rewards = torch.tensor([[0.1, 0.9, 0.5, 0.3]])
    (grad,) = torch.autograd.grad(plackett_luce_loss(scores, rewards, 0.05).sum(), scores)
    assert (-grad).argsort(descending=True).tolist() == [[1, 2, 3, 0]]
