"""The generic denoising rollout: a backbone predicts, a sampler steps, every transition is recorded.

Randomness is drawn per sample from a generator seeded by ``(seed, step, sample id)``, so a sample's
trajectory is the same on one process or many, and after a resume.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from gyremedia.interfaces import DenoisingBackbone, ObjectiveContext, Sampler, Transition, TransitionRecorder
from gyremedia.rollout import Rollout
from gyremedia.runtime.streams import sample_generators  # noqa: F401 - re-exported: samplers and backbones draw with it


def per_sample(value: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` tensor viewed as ``[B, 1, ...]`` to multiply ``states``."""
    return value.view(-1, *([1] * (states.dim() - 1)))


def renoise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """The flow's forward process ``x_t = (1 - t) x0 + t eps`` at level ``t``: a scalar, or ``[B]`` (one per sample)."""
    if isinstance(t, torch.Tensor) and t.dim() == 1:
        t = per_sample(t, x0)
    return (1 - t) * x0 + t * noise


def draw_noise(shape: torch.Size, generators: list[torch.Generator]) -> torch.Tensor:
    """Standard normal noise ``[len(generators), *shape]`` on the CPU, one row drawn from each generator (fp32)."""
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators])


def noise_like(x: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Standard normal noise shaped like ``x``, one row drawn from each generator (in fp32), on ``x``'s device."""
    return draw_noise(x.shape[1:], generators).to(device=x.device, dtype=x.dtype)


def stochastic_steps(sampler: Sampler, sigmas: torch.Tensor) -> list[int]:
    """The transitions of schedule ``sigmas`` that ``sampler`` will sample with a density (the ones a ratio
    objective can train): what it declares, or every transition where it declares nothing."""
    declared = getattr(sampler, "stochastic_steps", None)
    return list(declared(sigmas)) if declared is not None else list(range(len(sigmas) - 1))


@dataclass
class KeptComparison:
    """What a rollout's kept inputs were last compared with: the trajectories and sample ids training replays, the
    kept rows those samples are (None: all of them, in order), copied to each device once, and the transitions whose
    kept inputs those trajectories still hold."""

    trajectories: torch.Tensor
    sample_ids: torch.Tensor
    rows: torch.Tensor | None
    unchanged: frozenset[int] = frozenset()
    copies: dict[torch.device, torch.Tensor] = field(default_factory=dict)

    def rows_on(self, device: torch.device) -> torch.Tensor:
        """``rows`` on ``device``."""
        if self.rows is None:
            raise ValueError("every kept row is compared, in order: there is nothing to index")
        if device not in self.copies:
            self.copies[device] = self.rows.to(device)
        return self.copies[device]


@dataclass
class KeptForwards:
    """The policy's outputs at some transitions of a rollout's first chunk, computed with gradients while it was
    sampled (``train.reuse_rollout_forward``). Until the first optimizer step changes the weights they are exactly
    what a replay of those transitions would compute, so training takes them (each once: its backward frees the
    graph) instead of running the model again."""

    sample_ids: torch.Tensor  # [B] the samples the outputs are of, in their rows' order
    indices: frozenset[int]  # the transitions whose outputs are kept
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # transition -> output [B, ...] with its graph
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # transition -> the states [B, ...] it was of
    compared: KeptComparison | None = None

    def keep(self, index: int, state: torch.Tensor, output: torch.Tensor) -> None:
        """Keep the policy's ``output`` at transition ``index`` and the ``state`` it was computed from."""
        self.inputs[index], self.outputs[index] = state, output

    def drop(self, index: int) -> None:
        """Free transition ``index``'s kept output and its graph."""
        self.inputs.pop(index, None)
        self.outputs.pop(index, None)

    def take(self, index: int, sample_ids: torch.Tensor, trajectories: torch.Tensor) -> torch.Tensor | None:
        """The kept output of transition ``index`` for ``sample_ids`` (a subset of the kept rows), or None; None
        too when ``trajectories`` (the states ``[B, S+1, ...]`` training replays) are not the ones it was computed
        from, e.g. after a plugin rewrote the rollout. The first take of given trajectories compares every kept
        transition's states with them at once (one read of the device, not one per take; an update does not edit
        them)."""
        output = self.outputs.pop(index, None)
        if output is None:
            return None
        compared = self.compared
        if compared is None or compared.trajectories is not trajectories or compared.sample_ids is not sample_ids:
            compared = self.compared = self.compare(sample_ids, trajectories)
        if index not in compared.unchanged:
            return None
        return output if compared.rows is None else output[compared.rows_on(output.device)]

    def compare(self, sample_ids: torch.Tensor, trajectories: torch.Tensor) -> KeptComparison:
        """Which kept transitions the samples ``sample_ids`` with ``trajectories`` can take (none if one of the
        samples was not kept)."""
        match = sample_ids.to(self.sample_ids.device)[:, None] == self.sample_ids[None, :]
        if not bool(match.any(dim=1).all()):
            return KeptComparison(trajectories, sample_ids, None)
        rows = match.int().argmax(dim=1)
        in_order = torch.equal(rows, torch.arange(len(self.sample_ids), device=rows.device))
        compared = KeptComparison(trajectories, sample_ids, None if in_order else rows)
        flags = {}
        for index, given in self.inputs.items():
            given = given if in_order else given[compared.rows_on(given.device)]
            state = trajectories[:, index].to(given.device)
            flags[index] = (
                (given == state).all()
                if given.shape == state.shape and given.dtype == state.dtype
                else torch.tensor(False, device=given.device)
            )
        if flags:
            first = next(iter(flags.values())).device
            read = torch.stack([flag.to(first) for flag in flags.values()]).tolist()
            compared.unchanged = frozenset(index for index, flag in zip(flags, read) if flag)
        return compared

    @classmethod
    def discard(cls, rollout: Rollout) -> None:
        """Drop a rollout's kept outputs and their graphs: the weights are about to change."""
        kept, rollout.kept_forwards = rollout.kept_forwards, None
        if kept is not None:
            kept.outputs.clear()
            kept.inputs.clear()
            kept.compared = None


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """``log N(x; mean, std^2)`` of every element, in fp32 (a deterministic step, std 0, gives NaN)."""
    x, mean = x.float(), mean.float()
    std = std.float() if isinstance(std, torch.Tensor) else torch.full_like(mean, std)
    return -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)


def patch_log_probs(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float, patch: int) -> torch.Tensor:
    """``[B, T]``: the Gaussian log-density of ``x`` under ``N(mean, std^2)`` averaged within each ``patch x patch``
    square of the last two dimensions (over every other dimension too: channels, frames), tokens in row-major
    order, as a DiT patchifies. Their mean over tokens is the transition's log-prob (the mean over every
    dimension) when the grid divides by ``patch``; a sampler's deterministic step (std 0) gives NaN."""
    density = gaussian_log_density(x, mean, std)
    grid = density.reshape(x.shape[0], -1, *x.shape[-2:]).mean(dim=1, keepdim=True)
    return torch.nn.functional.avg_pool2d(grid, patch).flatten(1)


def frame_log_probs(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float, frame_dim: int) -> torch.Tensor:
    """``[B, T]``: the Gaussian log-density of video states ``x`` under ``N(mean, std^2)`` averaged over each frame's
    elements (``frame_dim`` indexes the frames); their mean over frames is the transition's log-prob."""
    return gaussian_log_density(x, mean, std).movedim(frame_dim, 1).flatten(2).mean(dim=2)


class ChunkedRecord:
    """What a :class:`~gyremedia.interfaces.TransitionRecorder` kept per transition index, over a rollout's chunks:
    ``result`` is ``[B, len(indices), ...]`` in index order."""

    key = ""

    def __init__(self) -> None:
        self.parts: dict[int, list[torch.Tensor]] = {}

    def keep(self, index: int, value: torch.Tensor) -> None:
        self.parts.setdefault(index, []).append(value.detach())

    def result(self) -> torch.Tensor:
        return torch.stack([torch.cat(self.parts[i]) for i in sorted(self.parts)], dim=1)


class PartLogProbs(ChunkedRecord):
    """Every transition's log-probs per part of the state (``[B, S, P]``), NaN for a step without a density (a
    deterministic one). Subclasses say how many parts a state has and what each part's log-prob is."""

    def part_count(self, x: torch.Tensor) -> int:
        raise NotImplementedError

    def log_probs(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
        raise NotImplementedError

    def record(self, index: int, transition: Transition) -> None:
        x = transition.next_state
        if transition.mean is None or transition.std is None:
            self.keep(index, torch.full((x.shape[0], self.part_count(x)), float("nan"), device=x.device))
        else:
            self.keep(index, self.log_probs(x, transition.mean, transition.std))


class PatchLogProbs(PartLogProbs):
    """Every transition's log-probs per patch token (spatial credit's old policy): ``[B, S, T]``."""

    key = "token_log_probs"

    def __init__(self, patch: int) -> None:
        super().__init__()
        self.patch = patch

    def part_count(self, x: torch.Tensor) -> int:
        return (x.shape[-2] // self.patch) * (x.shape[-1] // self.patch)

    def log_probs(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
        return patch_log_probs(x, mean, std, self.patch)


class FrameLogProbs(PartLogProbs):
    """Every transition's log-probs per video frame (per-frame credit's old policy for a ratio objective):
    ``[B, S, T]``."""

    key = "frame_log_probs"

    def __init__(self, frame_dim: int) -> None:
        super().__init__()
        self.frame_dim = frame_dim

    def part_count(self, x: torch.Tensor) -> int:
        return x.shape[self.frame_dim]

    def log_probs(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
        return frame_log_probs(x, mean, std, self.frame_dim)


class StepMeans(ChunkedRecord):
    """The Gaussian step means of the transitions at ``indices`` (GRPO-Guard's old policy), ``{index: [B, ...]}``;
    memory grows with the transitions trained, not with all of them."""

    key = "old_means"

    def __init__(self, indices: list[int]) -> None:
        super().__init__()
        self.indices = frozenset(indices)

    def record(self, index: int, transition: Transition) -> None:
        if index not in self.indices:
            return
        if transition.mean is None:
            raise ValueError(f"transition {index} has no Gaussian mean to record: use a stochastic sampler there")
        self.keep(index, transition.mean.float())

    def result(self) -> dict[int, torch.Tensor]:  # type: ignore[override]  # one tensor per recorded index
        return {i: torch.cat(parts) for i, parts in self.parts.items()}


@torch.no_grad()
def sample_trajectories(
    backbone: DenoisingBackbone,
    sampler: Sampler,
    conditions: dict[str, torch.Tensor],
    *,
    initial_generators: list[torch.Generator],
    step_generators: list[torch.Generator],
    num_steps: int,
    guidance_scale: float,
    keep: KeptForwards | None = None,
    recorders: Sequence[TransitionRecorder] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Roll out one batch; returns ``states [B, S+1, ...]``, ``log_probs [B, S]`` (or None) and ``sigmas``.

    With ``keep``, the model's outputs at ``keep.indices`` are computed with gradients and stored in it
    (the trajectory itself carries none: every step continues from the detached output). Every transition is
    handed to each of the ``recorders``."""
    x = backbone.sample_noise(initial_generators)
    sigmas = backbone.sigmas(num_steps).to(x.device)
    states, log_probs = [x], []

    def predict(state: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return backbone.predict(state, sigma, conditions, guidance_scale)

    extra: dict[str, Any] = {"predict": predict} if getattr(sampler, "needs_predict", False) else {}
    for i in range(num_steps):
        kept = keep if keep is not None and i in keep.indices else None
        with torch.enable_grad() if kept is not None else contextlib.nullcontext():
            output = predict(x, sigmas[i])
        if kept is not None and output.requires_grad:
            kept.keep(i, x, output)
            output = output.detach()
        noise = noise_like(x, step_generators) if sampler.has_log_prob else None
        transition = sampler.step(x, output, sigmas, i, noise=noise, **extra)
        if kept is not None and (transition.log_prob is None or not bool(torch.isfinite(transition.log_prob).all())):
            kept.drop(i)  # a deterministic step is never trained: free its graph now
        for recorder in recorders:
            recorder.record(i, transition)
        x = transition.next_state
        states.append(x)
        if transition.log_prob is not None:
            log_probs.append(transition.log_prob)
    stacked_log_probs = torch.stack(log_probs, dim=1) if log_probs else None
    return torch.stack(states, dim=1), stacked_log_probs, sigmas


def replay_transition(
    ctx: ObjectiveContext, rollout: Rollout, index: int, *, reference: bool = False
) -> tuple[Transition, torch.Tensor]:
    """Recompute transition ``index`` of a recorded rollout under the current (or reference) policy.

    Returns the sampler's transition (mean, std and the log-prob of the recorded next state) and
    the model output, so objectives and regularizers can use either. The policy's output is the one kept
    while sampling where the rollout holds it (:class:`KeptForwards`).
    """
    if rollout.sigmas is None:
        raise ValueError("replay needs a denoising rollout with sigmas")
    x = rollout.states[:, index]
    kept = None if reference else rollout.kept_forwards
    output = kept.take(index, rollout.sample_ids, rollout.states) if kept is not None else None
    if ctx.sampler is None:
        raise ValueError("replay needs the run's sampler (a policy that samples its own tokens replays none)")
    if output is None:
        backbone = cast(DenoisingBackbone, ctx.backbone)  # a rollout with sigmas is a denoising policy's
        output = backbone.predict(x, rollout.sigmas[index], rollout.conditions, ctx.guidance_scale, reference=reference)
    transition = ctx.sampler.step(x, output, rollout.sigmas, index, next_state=rollout.states[:, index + 1])
    return transition, output
