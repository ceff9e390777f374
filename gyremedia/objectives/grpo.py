"""GRPO on transitions (Flow-GRPO / DanceGRPO for media, GRPO for tokens).

For each trained transition i of sample b, with advantage A_b and r = pi_theta / pi_old:

    L = mean_b,i max(-A_b r, -A_b clip(r, 1 - eps, 1 + eps))  +  beta * KL(pi_theta || pi_ref)

(``clipped_ratio_loss``, the same function token GRPO uses).

The KL term is the ``gaussian_kl`` regularizer: ``kl_beta`` is a shortcut that selects it with that
weight (see its module for the exact form and Flow-GRPO's scaling).

With per-frame advantages ``A_bt`` (``advantage.per_frame``, video) each frame t has its own log-prob (the
transition's density averaged over the frame's elements; their mean is the transition's), ratio ``r_t`` and
advantage, and ``L = mean_b,i,t max(-A_bt r_t, -A_bt clip(r_t, 1 - eps, 1 + eps))``: the same as above when every
frame has the sample's advantage and the ratios are 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, LossOutput, ObjectiveContext, Transition
from gyremedia.objectives.clipped_ratio import clipped, clipped_ratio_loss
from gyremedia.options import option
from gyremedia.rollout import Rollout
from gyremedia.runtime.streams import Stream, stream_rng
from gyremedia.sampling import frame_log_probs, replay_transition


@dataclass
class GRPOOptions:
    clip_range: float = option(
        1e-4, gt=0, help="PPO clip eps of the ratio; Flow-GRPO's 1e-4 is tiny because log-probs average over dimensions"
    )
    adv_clip_max: float = option(5.0, gt=0, help="advantages are clipped to [-adv_clip_max, adv_clip_max]")
    kl_beta: float = option(
        0.0,
        ge=0,
        help="weight of the KL to the reference policy (selects the gaussian_kl regularizer); 0 keeps no reference",
    )
    timestep_fraction: float = option(
        1.0, gt=0, le=1, help="share of each trajectory's stochastic transitions trained per step"
    )
    # Which ones: Flow-GRPO trains the first floor(N f), the noisiest; its log-prob divides by the step variance,
    # which is small late in the trajectory, so late picks give larger, noisier gradients. Why `first` is the
    # default: docs/benchmarks.md, "Defaults and why".
    transition_selection: Literal["random", "first", "stratified", "window"] = option(
        "first",
        help="first: the first floor(N f) (Flow-GRPO); random: round(N f) drawn each step; stratified: one "
        "from each of round(N f) equal strata; window: round(N f) consecutive ones at a random start",
    )
    skip_zero_advantage: bool = option(
        False,
        help="leave samples whose advantage is exactly 0 (a group whose rewards "
        "all tie) out of the loss, as Flow-GRPO does: they add no policy "
        "gradient, only replay cost and a smaller mean",
    )


@dataclass
class TrainedRows:
    """A minibatch's trained rows in flat GRPO, the same at each of its micro-steps: found once, since finding
    them (``skip_zero_advantage``) and selecting them each wait for the device."""

    rollout: Rollout  # the minibatch
    found_from: torch.Tensor  # its advantages when they were found
    rows: torch.Tensor | None  # None: every sample
    advantages: torch.Tensor  # the rows' advantages
    samples: Rollout  # the rows' samples


class GRPOObjective:
    """The clipped-ratio policy gradient over a rollout's recorded transitions."""

    name = "grpo"
    requires_log_prob = True
    transitions = "denoising"  # it replays sampler steps
    plans_transitions = True  # planned_transitions: what it will replay, before the rollout
    kl_regularizer = "gaussian_kl"  # what `kl_beta` selects
    per_frame = True  # frame_terms: a ratio and an advantage per video frame

    def __init__(self, options: GRPOOptions, context: BuildContext) -> None:
        self.options = options
        self.seed = context.seed
        self._trained: TrainedRows | None = None  # flat GRPO's, found at a minibatch's first micro-step

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        """The transitions trained on this step, shared by the batch: all stochastic ones, or the
        ``transition_selection`` subset of them (deterministic steps are never trained)."""
        return self.select_transitions(self.trainable_steps(rollout), step)

    def planned_transitions(self, stochastic: list[int], step: int) -> list[int]:
        """The transitions step ``step`` will train, known before the rollout is sampled from the ones its sampler
        will sample ``stochastic``ally (``train.reuse_rollout_forward`` keeps the rollout's forwards of them)."""
        return self.select_transitions(stochastic, step)

    def select_transitions(self, trainable: list[int], step: int) -> list[int]:
        """The ``transition_selection`` subset of the ``trainable`` transitions for step ``step``."""
        how, fraction = self.options.transition_selection, self.options.timestep_fraction
        count = max(
            1, math.floor(len(trainable) * fraction + 1e-9) if how == "first" else round(len(trainable) * fraction)
        )
        if count >= len(trainable):
            return trainable
        if how == "first":
            return trainable[:count]
        rng = stream_rng(self.seed, step, Stream.TRANSITION_SELECTION)
        if how == "window":
            start = int(rng.integers(len(trainable) - count + 1))
            return trainable[start : start + count]
        if how == "stratified":
            edges = [round(k * len(trainable) / count) for k in range(count + 1)]
            return [trainable[int(rng.integers(lo, hi))] for lo, hi in zip(edges[:-1], edges[1:])]
        return sorted(rng.choice(trainable, size=count, replace=False).tolist())

    def trainable_steps(self, rollout: Rollout) -> list[int]:
        """The stochastic transitions (a sampler may record deterministic steps with NaN log-probs)."""
        if rollout.log_probs is None:
            raise ValueError("grpo needs a rollout with log-probs: use a stochastic sampler")
        finite = torch.isfinite(rollout.log_probs).all(dim=0).tolist()  # one read of the device, not one per transition
        stochastic = [i for i, is_finite in enumerate(finite) if is_finite]
        if not stochastic:
            raise ValueError("grpo found no stochastic transition in the rollout to train on")
        return stochastic

    def transition_advantages(self, rollout: Rollout, micro_step: int) -> torch.Tensor:
        """The advantage of each sample's transition ``micro_step``: the sample's own, in flat GRPO."""
        return rollout.advantages

    def trained_rows(self, rollout: Rollout, micro_step: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The rows whose transition ``micro_step`` is trained (``None``: every sample, as in flat GRPO) and
        their advantages."""
        flat = type(self).transition_advantages is GRPOObjective.transition_advantages  # the same at every micro-step
        if not flat:
            return self.informative_rows(None, self.transition_advantages(rollout, micro_step))
        cached = self._trained
        if cached is None or cached.rollout is not rollout or cached.found_from is not rollout.advantages:
            rows, advantages = self.informative_rows(None, rollout.advantages)
            cached = self._trained = TrainedRows(
                rollout, rollout.advantages, rows, advantages, rollout if rows is None else rollout.select(rows)
            )
        return cached.rows, cached.advantages

    def trained_samples(self, rollout: Rollout, rows: torch.Tensor | None) -> Rollout:
        """``rollout``'s samples at ``rows`` (``None``: all); the ones :meth:`trained_rows` selected, when it did."""
        cached = self._trained
        if cached is not None and cached.rollout is rollout and cached.rows is rows:
            return cached.samples
        return rollout if rows is None else rollout.select(rows)

    def informative_rows(
        self, rows: torch.Tensor | None, advantages: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``rows`` (``None``: all) and their ``advantages`` without the zero-advantage ones when
        ``skip_zero_advantage`` is set. If every advantage is 0 all rows stay: the policy loss is then exactly
        0 and every process still runs the same forward and backward."""
        if not self.options.skip_zero_advantage:
            return rows, advantages
        kept = (advantages != 0).reshape(len(advantages), -1).any(dim=1).nonzero().flatten()  # one read of the device
        if len(kept) in (0, len(advantages)):
            return rows, advantages
        return (kept if rows is None else rows.to(kept.device)[kept]), advantages[kept]

    def replay(
        self, ctx: ObjectiveContext, rollout: Rollout, index: int, rows: torch.Tensor | None, samples: Rollout
    ) -> tuple[Transition, torch.Tensor]:
        """Transition ``index`` of the trained rows (``samples``: ``rollout``'s at ``rows``) under the current policy,
        and the model output it used."""
        return replay_transition(ctx, samples, index)

    def surrogate(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-element loss of the log-ratios (advantages broadcast) and its metrics: PPO's clipped ratio here;
        GIPO and GRPO-Guard put their own trust regions in its place."""
        eps = self.options.clip_range
        loss, ratio = clipped_ratio_loss(log_ratio, advantages, eps, eps)
        return loss, {"ratio": ratio.detach().mean(), "clip_fraction": clipped(ratio, eps, eps).float().mean()}

    def policy_terms(
        self, transition: Transition, samples: Rollout, micro_step: int, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-sample policy loss of the replayed ``transition`` against the recorded log-probs, and its metrics:
        one ratio per transition (Flow-GRPO); spatial credit splits it per token."""
        log_ratio = transition.log_prob - samples.log_probs[:, micro_step]
        per_sample, metrics = self.surrogate(log_ratio, advantages)
        metrics["approx_kl"] = 0.5 * (log_ratio.detach() ** 2).mean()
        return per_sample, metrics

    def frame_terms(
        self, transition: Transition, samples: Rollout, micro_step: int, advantages: torch.Tensor, frame_dim: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-sample policy loss with per-frame advantages ``[B, T]``: a ratio per frame, against the per-frame
        log-probs recorded while sampling (``FrameLogProbs``), each frame's surrogate with its own advantage."""
        if "frame_log_probs" not in samples.extras:
            raise ValueError(f"{self.name}: per-frame advantages need the rollout's per-frame log-probs (frame_credit)")
        new = frame_log_probs(transition.next_state, transition.mean, transition.std, frame_dim)
        log_ratio = new - samples.extras["frame_log_probs"][:, micro_step]
        per_frame, metrics = self.surrogate(log_ratio, advantages)
        metrics["approx_kl"] = 0.5 * (log_ratio.detach() ** 2).mean()
        return per_frame.mean(dim=1), metrics

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        if rollout.log_probs is None or rollout.advantages is None:
            raise ValueError(f"{self.name} needs a rollout with log-probs and advantages")
        rows, advantages = self.trained_rows(rollout, micro_step)
        samples = self.trained_samples(rollout, rows)
        transition, output = self.replay(ctx, rollout, micro_step, rows, samples)
        advantages = advantages.clamp(-self.options.adv_clip_max, self.options.adv_clip_max)
        if advantages.dim() == 2:
            per_sample, metrics = self.frame_terms(transition, samples, micro_step, advantages, ctx.backbone.frame_dim)
        else:
            per_sample, metrics = self.policy_terms(transition, samples, micro_step, advantages)
        policy_loss = per_sample.mean()
        metrics["policy_loss"] = policy_loss.detach()
        outputs = {
            "index": micro_step,
            "model_output": output,
            "transition": transition,
            "state": samples.states[:, micro_step],
            "sigma": samples.sigmas[micro_step],
            "sigmas": samples.sigmas,
            "conditions": samples.conditions,
        }
        return LossOutput(loss=policy_loss, metrics=metrics, outputs=outputs)


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "grpo",
        GRPOObjective,
        options=GRPOOptions,
        description="clipped-ratio GRPO over stochastic transitions (Flow-GRPO), optional KL",
    )
