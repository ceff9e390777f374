"""What the stochastic samplers here share: drawing (or replaying) a Gaussian step, and its density."""

import torch

from gyremedia.interfaces import Transition
from gyremedia.sampling import gaussian_log_density


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2)`` averaged over every non-batch dimension, in fp32.

    Averaging (not summing) over dimensions follows Flow-GRPO: it keeps ratios near 1 for large
    latents, so the clip range means the same thing at every resolution.
    """
    log_density = gaussian_log_density(x, mean, std)
    return log_density.mean(dim=tuple(range(1, log_density.dim())))


def draw_or_replay(
    mean: torch.Tensor,
    std: torch.Tensor | float,
    noise: torch.Tensor | None,
    next_state: torch.Tensor | None,
    dtype: torch.dtype,
    sampler: str,
) -> torch.Tensor:
    """``mean + std * noise`` when sampling, or the recorded ``next_state`` when replaying."""
    if next_state is not None:
        return next_state
    if noise is None:
        raise ValueError(f"{sampler} needs noise to sample a step")
    return (mean + std * noise.float()).to(dtype)


def gaussian_transition(
    x: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    noise: torch.Tensor | None,
    next_state: torch.Tensor | None,
    sampler: str,
) -> Transition:
    """A step ``N(mean, std^2)`` from ``x``, sampled or replayed, with its exact log-density."""
    next_state = draw_or_replay(mean, std, noise, next_state, x.dtype, sampler)
    log_prob = gaussian_log_prob(next_state.detach(), mean, std.expand_as(mean))
    return Transition(next_state=next_state, mean=mean, std=std, log_prob=log_prob)
