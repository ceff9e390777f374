"""The Gaussian transition density that every stochastic sampler here shares."""

import math

import torch


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2)`` averaged over every non-batch dimension, in fp32.

    Averaging (not summing) over dimensions follows Flow-GRPO: it keeps ratios near 1 for large
    latents, so the clip range means the same thing at every resolution.
    """
    x, mean, std = x.float(), mean.float(), std.float()
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.mean(dim=tuple(range(1, log_density.dim())))
