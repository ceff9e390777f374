"""The generic denoising rollout: a backbone predicts, a sampler steps, every transition is recorded.

Randomness is drawn per sample from a generator seeded by ``(seed, step, sample id)``, so a sample's
trajectory is the same on one process or many, and after a resume.
"""

from __future__ import annotations

import numpy as np
import torch

from gyremedia.interfaces import Backbone, ObjectiveContext, Sampler, Transition
from gyremedia.rollout import Rollout

#: Independent random streams of a sample: its initial noise and its per-step noise.
INITIAL_NOISE, STEP_NOISE = 0, 1


def sample_generators(seed: int, step: int, stream: int | tuple[int, ...], ids: list[int]) -> list[torch.Generator]:
    """One CPU generator per id, seeded from ``(seed, step, stream..., id)`` through numpy's SeedSequence."""
    streams = list(stream) if isinstance(stream, tuple) else [stream]
    generators = []
    for sample_id in ids:
        state = np.random.SeedSequence([seed, step, *streams, int(sample_id)]).generate_state(2, dtype=np.uint32)
        generators.append(torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1])))
    return generators


def noise_like(x: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Standard normal noise shaped like ``x``, one row drawn from each generator (in fp32)."""
    shape = x.shape[1:]
    noise = torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators])
    return noise.to(device=x.device, dtype=x.dtype)


@torch.no_grad()
def sample_trajectories(backbone: Backbone, sampler: Sampler, conditions: dict[str, torch.Tensor], *,
                        initial_generators: list[torch.Generator], step_generators: list[torch.Generator],
                        num_steps: int, guidance_scale: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Roll out one batch; returns ``states [B, S+1, ...]``, ``log_probs [B, S]`` (or None) and ``sigmas``."""
    x = backbone.sample_noise(initial_generators)
    sigmas = backbone.sigmas(num_steps).to(x.device)
    states, log_probs = [x], []

    def predict(state: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return backbone.predict(state, sigma, conditions, guidance_scale)

    extra = {"predict": predict} if getattr(sampler, "needs_predict", False) else {}
    for i in range(num_steps):
        output = predict(x, sigmas[i])
        noise = noise_like(x, step_generators) if sampler.has_log_prob else None
        transition = sampler.step(x, output, sigmas, i, noise=noise, **extra)
        x = transition.next_state
        states.append(x)
        if transition.log_prob is not None:
            log_probs.append(transition.log_prob)
    stacked_log_probs = torch.stack(log_probs, dim=1) if log_probs else None
    return torch.stack(states, dim=1), stacked_log_probs, sigmas


def replay_transition(ctx: ObjectiveContext, rollout: Rollout, index: int, *,
                      reference: bool = False) -> tuple[Transition, torch.Tensor]:
    """Recompute transition ``index`` of a recorded rollout under the current (or reference) policy.

    Returns the sampler's transition (mean, std and the log-prob of the recorded next state) and
    the model output, so objectives and regularizers can use either.
    """
    if rollout.sigmas is None:
        raise ValueError("replay needs a denoising rollout with sigmas")
    x = rollout.states[:, index]
    output = ctx.backbone.predict(x, rollout.sigmas[index], rollout.conditions, ctx.guidance_scale, reference=reference)
    transition = ctx.sampler.step(x, output, rollout.sigmas, index, next_state=rollout.states[:, index + 1])
    return transition, output


def transition_kl(policy: Transition, reference: Transition) -> torch.Tensor:
    """Per-sample ``KL(pi_theta || pi_ref)`` of two Gaussian steps with the same std (Flow-GRPO's form):
    ``||mean_theta - mean_ref||^2 / (2 std^2)``, averaged over the state's dimensions (``std`` a scalar)."""
    if policy.std is None or reference.mean is None:
        raise ValueError("a transition KL needs Gaussian transitions (mean and std) from a stochastic sampler")
    dims = tuple(range(1, policy.mean.dim()))
    std = torch.as_tensor(policy.std, dtype=torch.float32, device=policy.mean.device)
    gap = ((policy.mean.float() - reference.mean.float()) ** 2).mean(dim=dims)
    # A deterministic step (std 0, e.g. CPS's last) has no density to compare: no KL.
    return torch.where(std > 0, gap / (2 * std.clamp(min=1e-12) ** 2), torch.zeros_like(gap))
