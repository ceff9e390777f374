"""Timestep weightings of the ELBO surrogate, a pluggable choice of their own (section ``weighting:``).

The ELBO-based objectives (AWM, V-GRPO, pairwise) score a clean sample by a log-likelihood
surrogate of its flow-matching error ``l`` at noise level ``t``: ``log p ~ -w(t) l``. Which noise
levels ``w`` emphasises decides where the reward's signal lands (coarse layout at high ``t``,
detail at low ``t``), and the useful choice depends on the reward and the stage of learning. Fixed
profiles (``uniform``, ``t``, ``t2``, ``ghuber``), a budgeted choice among them (``budgeted``) and a
schedule that follows the reward gap (``dynamic``) are registered here; a third party registers its
own through ``gyremedia_register_weightings``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gyremedia import hookimpl
from gyremedia.options import OptionError, option
from gyremedia.smoothing import SmoothedMetric

logger = logging.getLogger("gyremedia")


def power_weight(t: torch.Tensor, power: float) -> torch.Tensor:
    """``(power + 1) t^power``: emphasises high noise for ``power > 0``, with mean 1 over uniform ``t``
    (so changing the profile moves the emphasis, not the loss scale)."""
    return (power + 1) * t**power


# --------------------------------------------------------------------------- fixed profiles


class Uniform:
    """``log p = -l``: every noise level counts the same (the plain flow-matching loss)."""

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -error


class LinearT:
    """``log p = -t l``: AWM's default, less weight on nearly clean states."""

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -t * error


class SquaredT:
    """``log p = -t^2 l``: the velocity error rescaled to the clean-sample error (``x0 = x_t - t v``)."""

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -(t**2) * error


@dataclass
class GHuberOptions:
    power: float = option(0.25, gt=0, le=1, help="p: errors enter as l^p / p, so large errors pull less")


class GeneralisedHuber:
    """``log p = -t l^p / p`` (the generalised-Huber form of the ELBO-weighting study)."""

    def __init__(self, options: GHuberOptions, context=None) -> None:
        self.power = options.power

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -t * error.clamp(min=1e-12) ** self.power / self.power


#: The fixed profiles by name (what ``budgeted`` chooses among).
PROFILES = {"uniform": Uniform(), "t": LinearT(), "t2": SquaredT(), "ghuber": GeneralisedHuber(GHuberOptions())}


# --------------------------------------------------------------------------- adaptive choices


@dataclass
class BudgetedOptions:
    profiles: list[str] = option(default_factory=lambda: ["uniform", "t", "t2"], help="names of fixed profiles")
    budget_steps: int = option(30, ge=2, help="exploration steps, shared round-robin among the profiles")

    def validate(self) -> None:
        unknown = [p for p in self.profiles if p not in PROFILES]
        if unknown or len(self.profiles) < 2:
            raise OptionError("profiles", f"give at least two of {', '.join(PROFILES)}")
        if self.budget_steps < 2 * len(self.profiles):
            raise OptionError("budget_steps", f"give each profile at least 2 steps (>= {2 * len(self.profiles)})")


class Budgeted:
    """Explore-then-commit among fixed profiles within a step budget.

    For ``budget_steps`` optimizer steps the profiles take turns (step k uses profile k mod n, so
    each sees every stage of the exploration); a profile is credited with the change of the
    training reward from the step it trained to the next one. Then the profile with the largest
    mean credit is used for the rest of the run. Metrics: ``weighting/profile`` (its index).
    """

    def __init__(self, options: BudgetedOptions, context=None) -> None:
        self.profiles = list(options.profiles)
        self.budget = options.budget_steps
        self.credits: list[list[float]] = [[] for _ in self.profiles]
        self.chosen: int | None = None
        self.step = 0  # optimizer steps seen
        self.last_reward: float | None = None

    def current(self) -> int:
        """Index of the profile the next optimizer step trains with."""
        return self.chosen if self.chosen is not None else self.step % len(self.profiles)

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return PROFILES[self.profiles[self.current()]](error, t)

    def mean_credits(self) -> list[float]:
        return [sum(c) / len(c) if c else float("-inf") for c in self.credits]

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics: dict[str, float]) -> None:
        # metrics["reward"] is the reward of the rollout this step trained on: the policy before its
        # update. So the reward change it caused shows up in the next step's rollout.
        reward = metrics["reward"]
        if self.chosen is None and self.last_reward is not None and self.step >= 1:
            self.credits[(self.step - 1) % len(self.profiles)].append(reward - self.last_reward)
        metrics["weighting/profile"] = float(self.current())
        self.last_reward = reward
        self.step += 1
        if self.chosen is None and self.step >= self.budget:
            credits = self.mean_credits()
            self.chosen = max(range(len(credits)), key=credits.__getitem__)
            logger.info(
                "weighting: chose %r after %d steps (mean reward change per step: %s)",
                self.profiles[self.chosen],
                self.step,
                ", ".join(f"{p} {c:+.4f}" for p, c in zip(self.profiles, credits)),
            )

    def state_dict(self) -> dict:
        return {"credits": self.credits, "chosen": self.chosen, "step": self.step, "last_reward": self.last_reward}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.credits, self.chosen = state["credits"], state["chosen"]
            self.step, self.last_reward = state["step"], state["last_reward"]


@dataclass
class DynamicOptions:
    early_power: float = option(2.0, ge=0, help="w(t) ∝ t^p while the reward gap is as large as at the start")
    late_power: float = option(0.0, ge=0, help="... and as the gap closes (0: uniform, detail counts as much)")
    smoothing: float = option(0.9, ge=0, lt=1, help="EMA factor of the measured gap")


class Dynamic:
    """``w(t) = (p + 1) t^p`` with ``p`` moving from ``early_power`` to ``late_power`` as the reward gap closes.

    The gap is the mean within-group reward spread (``reward_group_std``, over all ranks): how far
    the policy's typical sample is from what the reward favours among its own samples. ``p`` follows
    ``late + (early - late) * min(1, gap / gap_0)``, ``gap`` an EMA and ``gap_0`` the first step's.
    Metrics: ``weighting/power`` and ``weighting/gap``.
    """

    def __init__(self, options: DynamicOptions, context=None) -> None:
        self.options = options
        self.gap = SmoothedMetric(options.smoothing)

    @property
    def power(self) -> float:
        o = self.options
        if self.gap.value is None:
            return o.early_power
        progress = min(1.0, self.gap.value / max(self.gap.first, 1e-12))
        return o.late_power + (o.early_power - o.late_power) * progress

    def __call__(self, error: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return -power_weight(t, self.power) * error

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics: dict[str, float]) -> None:
        if self.gap.update(metrics.get("reward_group_std")):
            metrics["weighting/power"] = self.power
            metrics["weighting/gap"] = self.gap.value

    def state_dict(self) -> dict:
        return self.gap.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.gap.load_state_dict(state)


@hookimpl
def gyremedia_register_weightings(register):
    register("uniform", lambda context: Uniform(), description="log p = -l: every noise level alike")
    register("t", lambda context: LinearT(), description="log p = -t l (AWM's default)")
    register("t2", lambda context: SquaredT(), description="log p = -t^2 l: the clean-sample error")
    register("ghuber", GeneralisedHuber, options=GHuberOptions, description="log p = -t l^p / p: generalised Huber")
    register(
        "budgeted",
        Budgeted,
        options=BudgetedOptions,
        description="explore fixed profiles round-robin for a step budget, then keep the best",
    )
    register(
        "dynamic",
        Dynamic,
        options=DynamicOptions,
        description="w ∝ t^p, p moving from early_power to late_power as the in-group reward gap closes",
    )
