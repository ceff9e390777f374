"""DanceGRPO's SDE step for rectified-flow models.

With ``x0^ = x - sigma v`` the score of the noised data is ``-(x - (1 - sigma) x0^) / sigma^2``; one
Euler-Maruyama step of the reverse SDE with diffusion ``eta`` is

    x' = x + dt v - eta^2 / 2 dt score + eta sqrt(-dt) eps          (dt = sigma' - sigma < 0)

Gaussian, so its log-density is exact (averaged over dimensions, as Flow-SDE's).
"""

from dataclasses import dataclass

import torch

from gyremedia.interfaces import Transition
from gyremedia.options import option
from gyremedia_samplers.gaussian import gaussian_transition


@dataclass
class DanceSDEOptions:
    eta: float = option(0.3, gt=0, help="diffusion strength (DanceGRPO uses 0.3 for FLUX; the ode sampler has none)")


class DanceSDESampler:
    """One DanceGRPO SDE step with its Gaussian log-prob."""

    has_log_prob = True
    prediction = "velocity"

    def __init__(self, options: DanceSDEOptions, context=None) -> None:
        self.eta = options.eta

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        sigma, sigma_next = sigmas[index].float(), sigmas[index + 1].float()
        x32, v = x.float(), model_output.float()
        dt = sigma_next - sigma
        clean = x32 - sigma * v
        score = -(x32 - (1 - sigma) * clean) / sigma**2
        mean = x32 + dt * v - 0.5 * self.eta**2 * dt * score
        return gaussian_transition(
            x, mean, self.eta * torch.sqrt(-dt), noise=noise, next_state=next_state, sampler="dance_sde"
        )
