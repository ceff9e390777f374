"""DDIM with stochasticity ``eta`` for epsilon-prediction (variance-preserving) diffusion backbones: DDPO's sampler.

A VP backbone reports its noise levels as ``sigma = sqrt(1 - alpha_bar)`` (so the trajectory runs
from nearly pure noise down to ``sigma`` near 0, like the flow backbones' ``sigmas``) and predicts
the noise ``eps``. With ``a = alpha_bar_t``, ``a' = alpha_bar_prev``:

    x0^  = (x - sqrt(1 - a) eps) / sqrt(a)
    std  = eta sqrt((1 - a') / (1 - a)) sqrt(1 - a / a')
    x'   = sqrt(a') x0^ + sqrt(1 - a' - std^2) eps + std z

the step of diffusers' ``DDIMScheduler`` (``eta = 1`` is DDPM's posterior variance). The step is
Gaussian, so its log-density is exact (averaged over dimensions, as for Flow-SDE). A step with
``std = 0`` (``eta = 0``, or a last step to ``alpha_bar = 1``) is deterministic: its log-prob is NaN
and ratio objectives skip it.
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
    """One DDIM-eta step on an epsilon prediction, with its Gaussian log-prob."""

    has_log_prob = True
    prediction = "epsilon"

    def __init__(self, options: DDIMEtaOptions, context=None) -> None:
        self.eta = options.eta

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        sigma, sigma_next = sigmas[index].float(), sigmas[index + 1].float()
        if sigma >= 1:
            raise ValueError("ddim_eta needs noise levels sigma = sqrt(1 - alpha_bar) below 1 (alpha_bar > 0)")
        alpha, alpha_prev = 1 - sigma**2, 1 - sigma_next**2
        x32, eps = x.float(), model_output.float()
        clean = (x32 - sigma * eps) / alpha.sqrt()
        variance = (1 - alpha_prev) / (1 - alpha) * (1 - alpha / alpha_prev)
        std = self.eta * variance.clamp(min=0).sqrt()
        mean = alpha_prev.sqrt() * clean + (1 - alpha_prev - std**2).clamp(min=0).sqrt() * eps
        if std == 0:
            state = mean.to(x.dtype) if next_state is None else next_state
            return Transition(next_state=state, mean=mean, std=std,
                              log_prob=torch.full((x.shape[0],), float("nan"), device=x.device))
        return gaussian_transition(x, mean, std, noise=noise, next_state=next_state, sampler="ddim_eta")
