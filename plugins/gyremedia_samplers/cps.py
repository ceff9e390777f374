"""Coefficients-preserving sampling (CPS) for rectified-flow models.

Flow-SDE's step adds more noise than the schedule removes at low noise levels, which leaves grainy
samples. CPS keeps the coefficients of the predicted clean sample and noise exactly on the
schedule: with ``x0^ = x - sigma v`` and ``x1^ = x + (1 - sigma) v`` (predicted clean and noise),

    x' = (1 - sigma') x0^ + sqrt(sigma'^2 - std^2) x1^ + std eps,   std = sigma' sin(a pi / 2)

so ``x'`` is on the flow's path at ``sigma'`` whatever ``a`` is. Its log-prob is CPS's
``-||x' - mean||^2`` (mean over dimensions): the Gaussian's ``1 / (2 std^2)`` and constants are
dropped on purpose, so every step weighs the same in the ratio. The last step (``sigma' = 0``) is
deterministic.
"""

import math
from dataclasses import dataclass

import torch

from gyremedia.interfaces import Transition
from gyremedia.options import option
from gyremedia_samplers.gaussian import draw_or_replay


@dataclass
class CPSOptions:
    noise_level: float = option(
        0.8, gt=0, le=1, help="'a': std = sigma_next sin(a pi / 2); 1 replaces all predicted noise"
    )


class CPSSampler:
    """One coefficients-preserving step and its (unnormalised) log-prob."""

    has_log_prob = True
    prediction = "velocity"

    def __init__(self, options: CPSOptions, context=None) -> None:
        self.noise_level = options.noise_level

    def step_std(self, sigma_next: torch.Tensor) -> torch.Tensor:
        """The step's noise: ``sigma_next sin(a pi / 2)``, 0 only on the step to sigma 0."""
        return sigma_next * math.sin(self.noise_level * math.pi / 2)

    def stochastic_steps(self, sigmas: torch.Tensor) -> list[int]:
        """Every step with noise: all but a last one to sigma 0."""
        return [i for i in range(len(sigmas) - 1) if self.step_std(sigmas[i + 1].float()) > 0]

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        sigma, sigma_next = sigmas[index].float(), sigmas[index + 1].float()
        x32, v = x.float(), model_output.float()
        clean, pure_noise = x32 - sigma * v, x32 + (1 - sigma) * v
        std = self.step_std(sigma_next)
        mean = (1 - sigma_next) * clean + torch.sqrt(sigma_next**2 - std**2) * pure_noise
        next_state = draw_or_replay(mean, std, noise, next_state, x.dtype, "cps")
        if std == 0:  # the last step, to sigma 0, is deterministic: no density, ratio objectives skip it
            return Transition(
                next_state=next_state,
                mean=mean,
                std=std,
                log_prob=torch.full((x.shape[0],), float("nan"), device=x.device),
            )
        dims = tuple(range(1, mean.dim()))
        log_prob = -((next_state.detach().float() - mean) ** 2).mean(dim=dims)
        return Transition(next_state=next_state, mean=mean, std=std, log_prob=log_prob)
