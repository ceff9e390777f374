"""Flow-GRPO's ODE-to-SDE conversion for rectified-flow models.

With ``x_sigma = (1 - sigma) x0 + sigma eps`` and velocity ``v = eps - x0``, the reverse SDE

    dx = [v + std^2 / (2 sigma) (x + (1 - sigma) v)] dt + std dW,   std = a sqrt(sigma / (1 - sigma))

has the same marginals as the flow ODE, so one Euler-Maruyama step is Gaussian with a closed-form
log-density: exactly what a ratio-based objective (GRPO) needs.
"""

from dataclasses import dataclass

import torch

from gyremedia.interfaces import Transition
from gyremedia.options import option
from gyremedia_samplers.gaussian import gaussian_transition


@dataclass
class FlowSDEOptions:
    noise_level: float = option(
        0.7, gt=0, help="'a' in Flow-GRPO: how much noise each step injects (the ode sampler injects none)"
    )


class FlowSDESampler:
    """One Euler-Maruyama step of the marginal-preserving SDE, with its Gaussian log-prob."""

    has_log_prob = True
    prediction = "velocity"

    def __init__(self, options: FlowSDEOptions, context=None) -> None:
        self.noise_level = options.noise_level

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        sigma, sigma_next = sigmas[index].float(), sigmas[index + 1].float()
        x32, v = x.float(), model_output.float()
        dt = sigma_next - sigma  # negative: sigma decreases towards 0
        # At sigma = 1 the ratio sigma / (1 - sigma) is infinite; Flow-GRPO uses sigmas[1] there.
        denominator = 1 - torch.where(sigma == 1, sigmas[1].float(), sigma)
        std_dev = self.noise_level * torch.sqrt(sigma / denominator)
        drift = v + std_dev**2 / (2 * sigma) * (x32 + (1 - sigma) * v)
        mean = x32 + dt * drift
        return gaussian_transition(
            x, mean, std_dev * torch.sqrt(-dt), noise=noise, next_state=next_state, sampler="flow_sde"
        )
