"""The contracts between the core and its components (what a plugin's factory must return).

These are ``typing.Protocol`` classes: a component satisfies one by shape, it never subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from gyremedia.config import RolloutSection
    from gyremedia.rollout import Media, Rollout


@dataclass
class BuildContext:
    """What a component factory may need besides its options."""

    device: torch.device
    run_dir: Path | None = None
    accelerator: Accelerator | None = None
    seed: int = 0
    is_main_process: bool = True
    mixed_precision: str = "none"  # train.mixed_precision: the autocast dtype policies compute in ("none", "bf16")


@dataclass
class RolloutRequest:
    """One rank's share of a step, as the trainer hands it to the policy's rollout stage."""

    step: int
    seed: int
    prompts: list[str]  # one per sample
    sample_ids: torch.Tensor  # [B] each sample's index in the step's global batch (its noise depends on it)
    group_ids: torch.Tensor  # [B] its prompt group's index in the global batch
    chunks: int  # training replays the rollout in this many minibatches: sample in the same chunks
    settings: RolloutSection  # the core ``rollout`` section (group size, steps, guidance, tree branching, ...)
    preference: torch.Tensor | None = None  # [B, R] a Pareto run's reward-preference weights
    # Where each sample's initial noise comes from: generators keyed by (seed, step, noise_stream, noise id);
    # None: the sample's id (its group's with same_noise_in_group). Candidate selection sets both.
    noise_ids: torch.Tensor | None = None
    noise_stream: int = 0  # Stream.INITIAL_NOISE
    # train.reuse_rollout_forward: the transitions whose model outputs on the first chunk are computed with
    # gradients and kept for training (gyremedia.sampling.KeptForwards); a policy may ignore it (training replays)
    keep_forwards: tuple[int, ...] = ()
    # what an objective needs recorded of each sampled transition beyond its log-prob (per-token log-probs, the
    # step means): each recorder's result goes in ``rollout.extras[recorder.key]`` (:class:`TransitionRecorder`)
    recorders: list[TransitionRecorder] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # what preparing it measured: the rollout's metrics


@runtime_checkable
class TransitionRecorder(Protocol):
    """Keeps something of the sampled transitions for training (what the old policy computed), so training needs
    no forward to recompute it. Chunks of a rollout are recorded in order; ``result`` joins them."""

    key: str  # the rollout keeps the result in ``rollout.extras[key]``

    def record(self, index: int, transition: Transition) -> None: ...

    def result(self) -> Any: ...  # batch-indexed tensors (or a dict of them): Rollout.select slices it


@dataclass
class Generated:
    """Samples for evaluation: their media, and what further measurements need (final states, token ids)."""

    media: Media
    extras: dict[str, Any] = field(default_factory=dict)


class Shardable(Protocol):
    """A policy that declares ``shardable = True`` (see :class:`Policy`)."""

    def shard(self) -> int: ...

    def unshard(self) -> None: ...


class Prefetching(Protocol):
    """A policy that declares ``prefetches = True`` (see :class:`Policy`)."""

    def prefetch(self, prompts: list[str]) -> None: ...


class Preparing(Protocol):
    """An objective that declares ``prepares = True`` (see :class:`Objective`)."""

    def prepare(self, ctx: ObjectiveContext, rollout: Rollout) -> None: ...


class Compilable(Protocol):
    """A policy that declares ``compilable = True`` (see :class:`Policy`)."""

    def compile(self) -> None: ...


@runtime_checkable
class Policy(Protocol):
    """A generator as the trainer drives it: a policy that emits a sequence of stochastic transitions.

    The policy owns how a rollout is collected (denoising trajectories, trees, token generation) and
    how its media and evaluation samples are made. Its class declares ``media_kind`` and
    ``transitions`` (``"denoising"``: sampler steps of a state; ``"tokens"``: sampled tokens).

    Optional methods, each with the capability that declares it (so the config refuses the key before any
    model loads for a policy without it):

    - ``shard() -> int`` and ``unshard()`` (``shardable = True``): shard its networks over the processes with
      FSDP2 after :meth:`enable_reference` (``train.sharding: fsdp2``), returning the number of blocks sharded;
      at the end of the run give the main process whole networks to export (a collective).
    - ``compile() -> None`` (``compilable = True``): compile its networks with ``torch.compile`` in place after
      :meth:`enable_reference` (``train.compile``); parameter names, checkpoints and exports stay as they are.
    - ``prefetch(prompts) -> None`` (``prefetches = True``): start preparing the next step's prompts (e.g.
      encoding them) in the background while this step trains.
    """

    media_kind: str

    def trainable_module(self) -> torch.nn.Module:
        """The module whose trainable parameters the optimizer updates (LoRA-wrapped if enabled)."""

    def set_training_module(self, module: torch.nn.Module) -> None:
        """Use ``module`` (the accelerate-prepared wrapper) for forwards that need gradients."""

    def enable_reference(self) -> None:
        """Keep the frozen reference policy (the base model) that KL terms and the monitor compare with."""

    def collect_rollout(self, request: RolloutRequest, sampler: Sampler | None) -> Rollout:
        """Sample the request's prompts (the default of the rollout stage); ``sampler`` is the run's, if any."""

    def media(self, rollout: Rollout) -> Media:
        """The rollout's outputs as media for the rewards."""

    def generate(
        self,
        prompts: list[str],
        *,
        seed: int,
        sampler: Sampler | None,
        num_steps: int,
        guidance_scale: float,
        preference: torch.Tensor | None = None,
    ) -> Generated:
        """One evaluation sample per prompt, sample ``i`` seeded by ``(seed, i)`` alone."""

    def reference_drift(
        self,
        prompts: list[str],
        generated: Generated,
        *,
        levels: int,
        guidance_scale: float,
        preference: torch.Tensor | None = None,
    ) -> float:
        """How far the policy has moved from the reference on evaluation samples (0 at the start)."""

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights to checkpoint (adapters only under LoRA)."""

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`trainable_state_dict` returned."""

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """Write the generator as a folder its library's stock loader reads (adapters merged, or alone)."""


#: The config section and registration hook say "backbone": a backbone is a policy.
Backbone = Policy


@runtime_checkable
class DenoisingBackbone(Policy, Protocol):
    """A policy whose transitions are denoising steps: predicts a velocity (or noise) on a noise schedule.

    :class:`gyremedia.backbones.denoising.DenoisingPolicy` implements the policy stages from these.
    """

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Conditioning tensors for prompts, batch-indexed (cached per prompt where costly)."""

    def sample_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """Initial states ``x_0``, one per generator (so each sample's noise depends on its seed alone)."""

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The ``num_steps + 1`` noise levels of a trajectory, from most noisy down to 0."""

    def predict(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The model output (velocity for flow matching) at states ``x`` and noise level ``sigma``.

        ``sigma`` is a scalar (the whole batch) or ``[B]`` (one level per sample), on ``x``'s device.
        With ``reference=True`` it is the frozen reference policy's output (no gradients).
        """

    def flow_velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The velocity ``eps - x0`` at flow-path states ``x = (1 - t) x0 + t eps`` (what forward-process
        objectives train): ``predict`` itself for a flow backbone, a conversion of it for others."""

    def decode(self, final: torch.Tensor) -> Media:
        """Turn final states into media for the rewards."""


@runtime_checkable
class TokenPolicy(Policy, Protocol):
    """A policy whose transitions are sampled tokens (a causal language model)."""

    def token_log_probs(self, rollout: Rollout, *, reference: bool = False) -> torch.Tensor:
        """``[B, T]`` fp32 log-probs of the rollout's completion tokens under the current policy (with
        gradients) or the reference (without), at the sampling temperature; padding positions are 0."""


@dataclass
class Transition:
    """One step of a trajectory: the next state and its density under the sampler."""

    next_state: torch.Tensor
    mean: torch.Tensor | None = None  # mean of p(x_{i+1} | x_i)
    std: torch.Tensor | None = None  # its standard deviation (broadcastable to the state)
    log_prob: torch.Tensor | None = None  # [B], averaged over state dimensions


@runtime_checkable
class Sampler(Protocol):
    """A transition kernel: a model output and a state in, the next state (and its log-prob) out."""

    has_log_prob: bool

    def step(
        self,
        x: torch.Tensor,
        model_output: torch.Tensor,
        sigmas: torch.Tensor,
        index: int,
        *,
        noise: torch.Tensor | None = None,
        next_state: torch.Tensor | None = None,
        predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> Transition:
        """Sample ``x_{index+1}`` with ``noise``, or score the given ``next_state`` (replay).

        A sampler that evaluates the model again within a step (a higher-order solver) sets
        ``needs_predict = True`` and receives ``predict(x, sigma)``: the same model and conditions.

        Optional: ``stochastic_steps(sigmas) -> list[int]``, the transitions of schedule ``sigmas`` it will sample
        with a density, as it stands before a rollout. A sampler with deterministic steps (NaN log-probs) declares
        them this way, so the trainer plans which forwards to keep (``train.reuse_rollout_forward``) from the
        transitions that can be trained; without it every transition is taken to be stochastic.
        """


@dataclass
class LossOutput:
    """What an objective returns for one micro-step."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)  # for regularizers: velocities, means, ...


@runtime_checkable
class Objective(Protocol):
    """Turns a scored rollout into losses, one micro-step at a time (gradients accumulate).

    Optional: ``prepare(ctx, rollout)`` (declared with ``prepares = True``), called once per rollout before its
    first update (e.g. to record the old policy's log-probs that several PPO iterations compare with). A class
    that declares ``needs_reference = True`` makes the backbone keep the frozen reference policy.
    """

    def micro_steps(self, rollout: Rollout, step: int) -> list[Any]:
        """The micro-steps of one optimizer step on ``rollout`` (e.g. the timesteps to train on)."""

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: Any) -> LossOutput:
        """The loss of one micro-step; the trainer backpropagates it divided by their count."""


@runtime_checkable
class TimestepWeighting(Protocol):
    """The ELBO surrogate ``log p = -w(t) l`` of per-sample flow-matching errors ``l [B]`` at levels ``t [B]``."""

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ObjectiveContext:
    """What an objective needs to recompute the policy on recorded transitions."""

    backbone: Policy
    sampler: Sampler | None  # the run's sampler (denoising policies)
    guidance_scale: float
    step: int
    weighting: TimestepWeighting | None = None  # the run's timestep weighting, for objectives that use one
    accelerator: Accelerator | None = None  # for objectives whose normaliser spans every rank (token counts)
    minibatches: int = 1  # optimizer steps per pass over the rollout (train.num_minibatches)
    passes: int = 1  # passes over the rollout (train.num_iterations): updates per rollout = minibatches x passes


@runtime_checkable
class Reward(Protocol):
    """Scores media against prompts: ``{"score": Tensor[B], other components...}`` or ``Tensor[B]``.

    Optional: a ``batch_size`` attribute (the core calls it on chunks of at most that size) and an
    ``async def __call__`` (chunks are awaited concurrently); see :mod:`gyremedia.scoring`.
    """

    kinds: set[str]

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor] | torch.Tensor: ...


def reward_components(output: dict[str, torch.Tensor] | torch.Tensor) -> dict[str, torch.Tensor]:
    """A reward's output as a dict: a bare tensor is its ``"score"``."""
    return {"score": output} if isinstance(output, torch.Tensor) else dict(output)


@runtime_checkable
class Regularizer(Protocol):
    """An extra loss term computed from an objective's micro-step outputs.

    ``outputs`` holds at least ``model_output`` (the policy's prediction, with gradient), ``state``,
    ``sigma`` and ``conditions`` (where it was made, for the rows the objective trained; ratio
    objectives add the replayed ``transition``, its ``index`` and the trajectory's ``sigmas``; forward-process
    objectives set ``flow_path``: their output is the policy's ``flow_velocity`` at flow-path states, not its
    own prediction). Returns named loss terms, or a :class:`LossOutput` (one loss
    plus metrics to log); the trainer adds them, times the regularizer's weight, to the loss.
    """

    def __call__(
        self, *, state: Any, rollout: Rollout, outputs: dict[str, Any]
    ) -> dict[str, torch.Tensor] | LossOutput: ...


@runtime_checkable
class Logger(Protocol):
    """A sink for per-step metrics (main process only)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...
