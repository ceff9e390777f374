"""Reward-adaptive strength for a regularizer: strong early and relaxed as the reward rises, or the reverse.

The training reward (``metrics["reward"]``, the mean over all ranks) is smoothed with an EMA; its
progress from the first step's value ``r_0`` to ``adapt_until`` sets the scale multiplying the
regularizer's loss:

    progress = clip((r_ema - r_0) / (adapt_until - r_0), 0, 1)
    relax:   scale = 1 - (1 - min_scale) progress        tighten: scale = min_scale + (1 - min_scale) progress

``relax`` anchors hard while the policy is far from what the reward wants and lets it go as it gets
there; ``tighten`` lets it explore first and holds it once the reward is reached (against hacking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gyremedia import hookimpl
from gyremedia.options import option
from gyremedia.smoothing import SmoothedMetric


@dataclass
class AdaptiveOptions:
    adapt: Literal["none", "relax", "tighten"] = option("none", help="how the strength follows the training reward")
    adapt_until: float = option(1.0, help="training reward at which the adaptation is complete")
    min_scale: float = option(0.1, ge=0, le=1, help="the scale at the relaxed end")
    smoothing: float = option(0.9, ge=0, lt=1, help="EMA factor of the training reward")


class RewardAdaptiveStrength:
    """Base of regularizers whose loss is scaled by the reward's progress (see the module docstring)."""

    def __init__(self, options: AdaptiveOptions, context=None) -> None:
        self.adaptive = options
        self.reward = SmoothedMetric(options.smoothing)

    @property
    def scale(self) -> float:
        o = self.adaptive
        if o.adapt == "none":
            return 1.0
        if self.reward.value is None:  # before the first step: no progress yet
            progress = 0.0
        else:
            span = o.adapt_until - self.reward.first
            progress = min(1.0, max(0.0, (self.reward.value - self.reward.first) / span)) if span > 0 else 1.0
        if o.adapt == "relax":
            return 1.0 - (1.0 - o.min_scale) * progress
        return o.min_scale + (1.0 - o.min_scale) * progress

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics: dict[str, float]) -> None:
        if self.adaptive.adapt != "none":
            self.reward.update(metrics.get("reward"))

    def state_dict(self) -> dict:
        return self.reward.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reward.load_state_dict(state)
