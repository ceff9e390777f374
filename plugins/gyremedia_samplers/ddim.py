"""DDIM with stochasticity ``eta`` for variance-preserving diffusion backbones: DDPO's sampler.

A VP backbone reports its noise levels as ``sigma = sqrt(1 - alpha_bar)`` (so the trajectory runs
from pure or nearly pure noise down to ``sigma`` near 0, like the flow backbones' ``sigmas``) and gives
the sampler diffusers' ``v = sqrt(a) eps - sqrt(1 - a) x0`` (``v_prediction``; an epsilon UNet's output is
converted by the backbone). With ``a = alpha_bar_t``, ``a' = alpha_bar_prev``:

    eps^ = sqrt(a) v + sqrt(1 - a) x             x0^ = sqrt(a) x - sqrt(1 - a) v
    std  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')
    x'   = sqrt(a') x0^ + sqrt(1 - a' - std^2) eps^ + std z

the step of diffusers' ``DDIMScheduler`` (``eta = 1`` is DDPM's posterior variance). Written on ``v``, the step
is defined at pure noise too (``a = 0``: ``eps^ = x``, ``x0^ = -v``), where a zero-terminal-SNR schedule
starts and an epsilon prediction says nothing about ``x0``. The step is Gaussian, so its log-density is
exact (averaged over dimensions, as for Flow-SDE). A step with ``std = 0`` (``eta = 0``, or a last step to
``alpha_bar = 1``) is deterministic: its log-prob is NaN and ratio objectives skip it.
"""

from dataclasses import dataclass

import torch

from gyremedia.interfaces import Transition
from gyremedia.options import option
from gyremedia_samplers.gaussian import gaussian_transition


@dataclass
class DDIMEtaOptions:
    eta: float = option(1.0, ge=0, help="0: deterministic DDIM; 1: DDPM's posterior variance (DDPO's default)")


class DDIMEtaSampler:
    """One DDIM-eta step on a ``v`` prediction, with its Gaussian log-prob."""

    has_log_prob = True
    prediction = "v_prediction"

    def __init__(self, options: DDIMEtaOptions, context=None) -> None:
        self.eta = options.eta

    def noise_scales(self, sigma: torch.Tensor, sigma_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's noise std and the predicted noise's weight in its mean."""
        alpha, alpha_prev = 1 - sigma**2, 1 - sigma_next**2
        # std^2 = (1 - a') r with r = (1 - a / a') / (1 - a) = (a' - a) / (a' (1 - a)), and the noise direction's
        # weight 1 - a' - std^2 = (1 - a') (1 - eta^2 r): exactly 0 at a = 0 with eta = 1 (the difference of the
        # two terms would leave the square root of a rounding error there, about 3e-4)
        ratio = ((alpha_prev - alpha) / (alpha_prev * (1 - alpha))).clamp(min=0)
        return self.eta * sigma_next * ratio.sqrt(), sigma_next * (1 - self.eta**2 * ratio).clamp(min=0).sqrt()

    def stochastic_steps(self, sigmas: torch.Tensor) -> list[int]:
        """The steps with noise: none at eta 0, and never the one to alpha_bar = 1."""
        sigmas = sigmas.float()
        return [i for i in range(len(sigmas) - 1) if self.noise_scales(sigmas[i], sigmas[i + 1])[0] > 0]

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        sigma, sigma_next = sigmas[index].float(), sigmas[index + 1].float()
        if not 0 < sigma <= 1:
            raise ValueError(f"ddim_eta needs noise levels sigma = sqrt(1 - alpha_bar) in (0, 1]; got {float(sigma)}")
        alpha, alpha_prev = 1 - sigma**2, 1 - sigma_next**2
        x32, v = x.float(), model_output.float()
        eps, clean = alpha.sqrt() * v + sigma * x32, alpha.sqrt() * x32 - sigma * v
        std, direction = self.noise_scales(sigma, sigma_next)
        mean = alpha_prev.sqrt() * clean + direction * eps
        if std == 0:
            state = mean.to(x.dtype) if next_state is None else next_state
            return Transition(
                next_state=state, mean=mean, std=std, log_prob=torch.full((x.shape[0],), float("nan"), device=x.device)
            )
        return gaussian_transition(x, mean, std, noise=noise, next_state=next_state, sampler="ddim_eta")
