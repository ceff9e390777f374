"""What the forward-process objectives (DiffusionNFT, AWM) share: re-noised samples and an old policy.

They never replay the sampler: they take each rollout's final clean sample ``x0``, noise it again
along the flow, ``x_t = (1 - t) x0 + t eps``, and train the velocity there, like pretraining does.
So they work with any sampler (the ODE and higher-order solvers included) and need no log-probs.
The velocity comes from the policy's ``flow_velocity``: a flow backbone's own prediction, or a diffusion
backbone's prediction converted exactly to the flow path (the policy owns the forward process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput
from gyremedia.options import OptionError, option
from gyremedia.rollout import Rollout
from gyremedia.runtime.streams import Stream, sample_generators, stream_rng
from gyremedia.sampling import draw_noise, per_sample, renoise


@dataclass
class NoisedBatch:
    """A rollout's clean samples re-noised at one level per sample."""

    t: torch.Tensor  # [B] noise levels in (0, 1)
    x0: torch.Tensor  # clean samples
    noise: torch.Tensor
    xt: torch.Tensor  # (1 - t) x0 + t noise

    def broadcast(self, value: torch.Tensor, frame_dim: int | None = None) -> torch.Tensor:
        """A ``[B]`` tensor, or a per-frame ``[B, T]`` one (``T`` along the states' ``frame_dim``), shaped to
        multiply the states."""
        if value.dim() == 1:
            return per_sample(value, self.x0)
        shape = [len(value)] + [1] * (self.x0.dim() - 1)
        shape[frame_dim] = value.shape[1]
        return value.view(shape)


def stratified_levels(seed: int, step: int, micro_steps: int, keys: list[int], low: float, high: float) -> np.ndarray:
    """``[micro_steps, B]`` noise levels: each sample gets one level in each of ``micro_steps`` equal
    strata of ``[low, high]`` (in a random order), so its micro-steps cover the whole range. Levels
    depend on the sample's key only (its sample id, or its group id to share them within a group)."""
    levels = np.empty((micro_steps, len(keys)))
    edges = np.linspace(low, high, micro_steps + 1)
    for column, key in enumerate(keys):
        rng = stream_rng(seed, step, Stream.RENOISE, key)
        order = rng.permutation(micro_steps)
        levels[:, column] = edges[order] + rng.random(micro_steps) * (edges[1] - edges[0])
    return levels


def renoising_draws(
    x0: torch.Tensor, levels: np.ndarray, seed: int, step: int, keys: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels ``[M, B]`` and noise ``[M, B, ...]`` of a minibatch's ``M`` micro-steps, on ``x0``'s device. The
    noise of micro-step ``m`` depends only on ``(seed, step, m, key)`` (the same on any number of processes). Drawn
    on the CPU and copied over once for all micro-steps: each copy to an accelerator makes the host wait for it."""
    noise = torch.stack(
        [
            draw_noise(x0.shape[1:], sample_generators(seed, step, (Stream.RENOISE, micro_step), keys))
            for micro_step in range(len(levels))
        ]
    )
    return (torch.as_tensor(levels, dtype=torch.float32, device=x0.device), noise.to(device=x0.device, dtype=x0.dtype))


def noised_batch(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> NoisedBatch:
    """The clean samples ``x0`` re-noised at levels ``t [B]`` with ``noise``."""
    return NoisedBatch(t=t, x0=x0, noise=noise, xt=renoise(x0, noise, t))


def normalised_error(error: torch.Tensor) -> torch.Tensor:
    """``[B]``: ``mean(e^2) / sg(mean |e|)`` over each sample's elements (clamped at 1e-5), the squared error scaled by
    its own detached magnitude (DiffusionNFT's and V-GRPO's adaptive weighting): every sample's gradient has the same
    scale whatever its noise level or how far off the model is."""
    dims = tuple(range(1, error.dim()))
    magnitude = error.detach().abs().mean(dim=dims).clamp(min=1e-5)
    return error.pow(2).mean(dim=dims) / magnitude


def group_means(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]``: the mean of ``values`` over the rows of each row's group (the rows present: a minibatch holds whole
    groups)."""
    _, inverse = group_ids.to(values.device).unique(return_inverse=True)
    sums = values.new_zeros(int(inverse.max()) + 1).index_add(0, inverse, values)
    counts = values.new_zeros(len(sums)).index_add(0, inverse, torch.ones_like(values))
    return (sums / counts)[inverse]


def whole_groups(group_ids: torch.Tensor, objective: str) -> int:
    """The group size of a minibatch whose groups all have the same number of rows (more than one): what a
    group-level loss needs. Raises a clear error otherwise."""
    counts = group_ids.unique(return_counts=True)[1]
    if len(counts.unique()) != 1 or int(counts[0]) < 2:
        raise ValueError(
            f"{objective} compares the samples of a group: every minibatch must hold whole groups (batch_size / "
            f"(processes x train.num_minibatches) a multiple of rollout.group_size); this one has group sizes "
            f"{sorted(set(counts.tolist()))}"
        )
    return int(counts[0])


class OldPolicy:
    """An exponential moving average of the trained weights, swapped in to predict with it.

    ``decay = 0`` keeps the weights that sampled the current rollout (updated after every step);
    larger values lag further behind, a soft trust region (DiffusionNFT's old policy). Costs one
    copy of the trainable weights (only the adapters under LoRA).
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.shadow: list[torch.Tensor] | None = None
        self._loaded: dict[str, torch.Tensor] | None = None  # restored from a checkpoint, placed on first use

    @staticmethod
    def _params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for p in module.parameters() if p.requires_grad]

    def ensure(self, module: torch.nn.Module) -> None:
        """Start from a loaded state, else from the current weights (the first rollout's sampling policy)."""
        if self.shadow is not None:
            return
        params = self._params(module)
        if self._loaded:
            self.shadow = [laid_out_like(self._loaded[str(i)], p) for i, p in enumerate(params)]
        else:
            self.shadow = [p.detach().clone() for p in params]
        self._loaded = None

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        """After an optimizer step: ``shadow = decay * shadow + (1 - decay) * weights``."""
        self.ensure(module)
        for shadow, p in zip(self.shadow, self._params(module)):
            shadow.lerp_(p.detach(), 1 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self, module: torch.nn.Module) -> Iterator[None]:
        """Within the block the module computes with the old weights: storage swapped, not copied, except for
        sharded (FSDP2) weights, which are copied in place: FSDP gathers from the shard's own storage."""
        self.ensure(module)
        params = self._params(module)
        sharded = any(hasattr(p, "device_mesh") for p in params)
        current = [p.detach().clone() if sharded else p.data for p in params]
        try:
            for p, shadow in zip(params, self.shadow):
                if sharded:
                    p.data.copy_(shadow)
                else:
                    p.data = shadow
            yield
        finally:
            for p, data in zip(params, current):
                if sharded:
                    p.data.copy_(data)
                else:
                    p.data = data

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The old weights, whole (sharded ones gathered: a collective every process calls)."""
        if self.shadow is None:  # not used since a resume (or ever): what was loaded, if anything
            return dict(self._loaded or {})
        return {str(i): (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu() for i, t in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            self.shadow, self._loaded = None, dict(state)


def laid_out_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``whole`` (a full tensor, the same on every process) on ``param``'s device and dtype, and, for a sharded
    parameter (a DTensor), cut into this process's shard the way ``param`` is."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(whole.to(param.dtype), param.device_mesh, param.placements)
    return whole.to(param.device, param.dtype)


@dataclass
class ForwardProcessOptions:
    """Options every forward-process objective shares."""

    adv_clip_max: float = option(5.0, gt=0, help="advantages are clipped to [-adv_clip_max, adv_clip_max]")
    old_policy_decay: float = option(
        0.0, ge=0, lt=1, help="EMA decay of the old policy per step; 0 = the policy that sampled"
    )
    timesteps: int = option(2, ge=1, help="re-noised levels per sample per step (one micro-step each, stratified)")
    t_min: float = option(0.0, ge=0, le=1, help="noise levels are drawn in [t_min, t_max]")
    t_max: float = option(1.0, ge=0, le=1, help="noise levels are drawn in [t_min, t_max]")
    kl_beta: float = option(
        0.0, ge=0, help="weight of ||v - v_ref||^2 to the reference policy (selects the velocity_kl regularizer)"
    )
    # The members of a group get the same noise levels and noise (V-GRPO's variance reduction: their
    # losses then differ by the samples alone).
    shared_in_group: bool = option(False, help="a group's members share noise levels and noise")

    def validate(self) -> None:
        if self.t_min >= self.t_max:
            raise OptionError("t_min", f"must be below t_max={self.t_max}")


class ForwardProcessObjective:
    """Base of the objectives that train on re-noised clean samples against an EMA old policy.

    Subclasses implement ``loss`` with :meth:`predictions` and :meth:`output`.
    """

    name = "forward_process"
    transitions = "denoising"  # it re-noises the final states
    per_frame = False  # whether its loss weights each video frame by its own advantage
    kl_regularizer = "velocity_kl"  # what `kl_beta` selects

    def __init__(self, options: ForwardProcessOptions, context) -> None:
        self.options = options
        self.seed = context.seed
        self.old = OldPolicy(options.old_policy_decay)
        # the minibatch micro_steps was given, and its clean samples, levels and noise for every micro-step
        self._draws: tuple[Rollout, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        """One micro-step per re-noised level; each sample's levels are stratified over [t_min, t_max]."""
        o = self.options
        keys = self._keys(rollout)
        levels = stratified_levels(self.seed, step, o.timesteps, keys, o.t_min, o.t_max)
        self._draws = None  # the last minibatch's go before this one's are drawn
        x0 = rollout.final.float()
        self._draws = (rollout, x0, *renoising_draws(x0, levels, self.seed, step, keys))
        return list(range(o.timesteps))

    def predictions(self, ctx, rollout: Rollout, micro_step: int) -> tuple[NoisedBatch, torch.Tensor, torch.Tensor]:
        """The re-noised batch of this micro-step, the policy's velocity on it and the old policy's."""
        if rollout.advantages is None:
            raise ValueError(f"{self.name} needs a rollout with advantages")
        if self._draws is None or self._draws[0] is not rollout:
            raise ValueError(f"{self.name}: call micro_steps(rollout, step) on this rollout first (it draws the noise)")
        _, x0, levels, noise = self._draws
        batch = noised_batch(x0, levels[micro_step], noise[micro_step])
        v = ctx.backbone.flow_velocity(batch.xt, batch.t, rollout.conditions, ctx.guidance_scale).float()
        if self.old_is_current(ctx):
            return batch, v, v.detach()
        with torch.no_grad(), self.old.swapped_in(ctx.backbone.trainable_module()):
            v_old = ctx.backbone.flow_velocity(batch.xt, batch.t, rollout.conditions, ctx.guidance_scale).float()
        return batch, v, v_old

    def old_is_current(self, ctx) -> bool:
        """Whether the old weights are the ones being trained: with decay 0 they are set to the trained weights
        after every step (exactly: ``lerp`` with weight 1), and with one update per rollout no optimizer step
        comes between that and this step's micro-steps. The old prediction is then the policy's own, detached,
        and costs no forward (DiffusionNFT's code runs it anyway). The same on every process (FSDP included)."""
        return self.options.old_policy_decay == 0 and ctx.minibatches * ctx.passes == 1

    def _keys(self, rollout: Rollout) -> list[int]:
        """What a sample's noise depends on: its group (shared within groups) or itself."""
        return (rollout.group_ids if self.options.shared_in_group else rollout.sample_ids).tolist()

    @staticmethod
    def elbo_log_p(ctx, v: torch.Tensor, batch: NoisedBatch, frame_dim: int | None = None) -> torch.Tensor:
        """The ELBO surrogate ``-w(t) l`` of each clean sample under velocity ``v``, ``l`` its mean
        flow-matching error on the re-noised batch and ``w`` the run's timestep weighting: ``[B]``, or each
        frame's ``[B, T]`` given the states' ``frame_dim`` (their mean over frames is the sample's)."""
        if ctx.weighting is None:
            raise ValueError("this objective needs a timestep weighting (the run's `weighting:` section)")
        dims = tuple(d for d in range(1, v.dim()) if d != frame_dim)
        error = (v - (batch.noise - batch.x0)).pow(2).mean(dim=dims)
        return ctx.weighting(error, batch.t if frame_dim is None else batch.t[:, None])

    def clipped_advantages(self, rollout: Rollout) -> torch.Tensor:
        """``[B]``, or ``[B, T]`` per frame (``advantage.per_frame``)."""
        return rollout.advantages.clamp(-self.options.adv_clip_max, self.options.adv_clip_max)

    @staticmethod
    def frame_dim(ctx, rollout: Rollout) -> int | None:
        """The states' frame axis when the advantages are per frame (``advantage.per_frame``), else None."""
        return ctx.backbone.frame_dim if rollout.advantages.dim() == 2 else None

    def output(
        self,
        ctx,
        rollout: Rollout,
        batch: NoisedBatch,
        v: torch.Tensor,
        policy_loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
    ) -> LossOutput:
        """The micro-step's result: the policy loss, its metrics, and the outputs regularizers read."""
        metrics["policy_loss"] = policy_loss.detach()
        # "flow_path": the output is the policy's flow_velocity at flow-path states (regularizers compare likewise)
        return LossOutput(
            loss=policy_loss,
            metrics=metrics,
            outputs={
                "model_output": v,
                "sigma": batch.t,
                "state": batch.xt,
                "conditions": rollout.conditions,
                "flow_path": True,
            },
        )

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics) -> None:
        self.old.update(state.backbone.trainable_module())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.old.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.old.load_state_dict(state)
