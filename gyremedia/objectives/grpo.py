"""GRPO on transitions (Flow-GRPO / DanceGRPO for media, GRPO for tokens).

For each trained transition i of sample b, with advantage A_b and r = pi_theta / pi_old:

    L = mean_b,i max(-A_b r, -A_b clip(r, 1 - eps, 1 + eps))  +  beta * KL(pi_theta || pi_ref)

where the Gaussian KL between two transitions of equal std is ||mean_theta - mean_ref||^2 / (2 std^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, LossOutput, ObjectiveContext
from gyremedia.rollout import Rollout
from gyremedia.sampling import replay_transition, transition_kl


@dataclass
class GRPOOptions:
    clip_range: float = 1e-4  # eps; Flow-GRPO's default, tiny because log-probs average over dims
    adv_clip_max: float = 5.0  # advantages are clipped to [-adv_clip_max, adv_clip_max]
    kl_beta: float = 0.0  # weight of the KL to the reference (base) policy; 0 keeps no reference
    timestep_fraction: float = 1.0  # share of each trajectory's transitions trained on per step


class GRPOObjective:
    """The clipped-ratio policy gradient over a rollout's recorded transitions."""

    def __init__(self, options: GRPOOptions, context: BuildContext) -> None:
        if not 0 < options.timestep_fraction <= 1:
            raise ValueError("objective.timestep_fraction must be in (0, 1]")
        self.options = options
        self.seed = context.seed
        self.needs_reference = options.kl_beta > 0

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        """The transitions trained on this step: all trainable ones, or a random subset shared by the batch."""
        trainable = self.trainable_steps(rollout)
        count = max(1, round(len(trainable) * self.options.timestep_fraction))
        if count >= len(trainable):
            return trainable
        rng = np.random.default_rng([self.seed, step, 2])
        return sorted(rng.choice(trainable, size=count, replace=False).tolist())

    def trainable_steps(self, rollout: Rollout) -> list[int]:
        """The stochastic transitions (a sampler may record deterministic steps with NaN log-probs)."""
        if rollout.log_probs is None:
            raise ValueError("grpo needs a rollout with log-probs: use a stochastic sampler")
        stochastic = [i for i in range(rollout.num_transitions) if torch.isfinite(rollout.log_probs[:, i]).all()]
        if not stochastic:
            raise ValueError("grpo found no stochastic transition in the rollout to train on")
        return stochastic

    def transition_advantages(self, rollout: Rollout, micro_step: int) -> torch.Tensor:
        """The advantage of each sample's transition ``micro_step``: the sample's own, in flat GRPO."""
        return rollout.advantages

    def trained_rows(self, rollout: Rollout, micro_step: int) -> tuple[Rollout, torch.Tensor]:
        """The rows whose transition ``micro_step`` is trained, and their advantages: every sample in flat GRPO."""
        return rollout, self.transition_advantages(rollout, micro_step)

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        if rollout.log_probs is None or rollout.advantages is None:
            raise ValueError("grpo needs a rollout with log-probs and advantages")
        eps = self.options.clip_range
        rollout, advantages = self.trained_rows(rollout, micro_step)
        transition, output = replay_transition(ctx, rollout, micro_step)
        advantages = advantages.clamp(-self.options.adv_clip_max, self.options.adv_clip_max)
        log_ratio = transition.log_prob - rollout.log_probs[:, micro_step]
        ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1 - eps, 1 + eps)
        policy_loss = torch.maximum(unclipped, clipped).mean()
        metrics = {
            "policy_loss": policy_loss.detach(),
            "ratio": ratio.detach().mean(),
            "clip_fraction": ((ratio - 1).abs() > eps).float().mean(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        }
        loss = policy_loss
        if self.options.kl_beta > 0:
            reference, _ = replay_transition(ctx, rollout, micro_step, reference=True)
            kl = transition_kl(transition, reference)
            loss = loss + self.options.kl_beta * kl.mean()
            metrics["kl"] = kl.detach().mean()
        outputs = {"index": micro_step, "model_output": output, "transition": transition,
                   "state": rollout.states[:, micro_step], "sigma": rollout.sigmas[micro_step],
                   "sigmas": rollout.sigmas, "conditions": rollout.conditions}
        return LossOutput(loss=loss, metrics=metrics, outputs=outputs)


@hookimpl
def gyremedia_register_objectives(register):
    register("grpo", GRPOObjective, options=GRPOOptions, requires_log_prob=True,
             description="clipped-ratio GRPO over stochastic transitions (Flow-GRPO), optional KL")
