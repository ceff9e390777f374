"""The reward-hacking monitor: is the policy getting better, or only better at the proxy?

At every evaluation it adds, beside the training rewards' scores on the eval prompts:

- ``eval/gold/<name>``: held-out "gold" rewards (``monitor.gold``), scored on the same eval media but
  never trained on: what the proxy is meant to stand for;
- ``eval/drift``: how far the policy has moved from the reference on the eval samples (with
  ``monitor.drift: true``; it keeps the reference policy), as the policy measures it
  (``reference_drift``): a denoising policy's ``mean ||v - v_ref||^2 / mean ||v_ref||^2`` at
  ``monitor.drift_levels`` noise levels, a token policy's mean per-token KL;

and warns (``monitor/hacking = 1`` and a log warning) when the proxy rose by more than
``monitor.tolerance`` since the previous evaluation while a gold reward fell by more than it, and
(``monitor/collapse = 1``) when in-group diversity fell below ``monitor.min_diversity`` times the
first evaluation's.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from gyremedia import hookimpl
from gyremedia.evaluation import EvalResult, hacking_warning, score, summary
from gyremedia.interfaces import BuildContext
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    gold = [s.name for s in selected.get("monitor.gold") or [] if s is not None]
    return [
        f"monitor.gold selects reward {name!r} twice: their scores would share eval/gold/{name}"
        for name in sorted({n for n in gold if gold.count(n) > 1})
    ]


@hookimpl
def gyremedia_setup(state: TrainState, context: BuildContext) -> None:
    """Every run is monitored: its gold rewards are built beside the run's own."""
    config = state.config
    gold = {s.name: state.plugins.build(s, context) for s in config.gold_rewards}
    monitor = HackingMonitor(
        config.core.monitor, gold, proxy=f"eval/{config.rewards[0].name}", selected=config.gold_rewards
    )
    state.reference_needed |= monitor.needs_reference
    state.stateful["monitor"] = monitor  # checkpointed under the name it has always had
    state.plugins.register_for_run(monitor, name="monitor:run")


class HackingMonitor:
    """Gold rewards, velocity drift and the proxy-up-gold-down warning at each evaluation."""

    def __init__(self, settings: Any, gold: dict[str, Any], proxy: str, selected: list[Any] = ()) -> None:
        """``proxy``: the metric key of the training reward the gold rewards are compared with; ``selected``: the
        gold rewards' selections (their failure policies)."""
        self.settings = settings
        self.gold = gold
        self.selected = list(selected)
        self.proxy = proxy  # metric key of the training proxy, e.g. "eval/shapes_verifier"
        self.previous: dict[str, float] | None = None
        self.first_diversity: float | None = None

    @property
    def needs_reference(self) -> bool:
        return bool(self.settings.drift)

    @hookimpl(tryfirst=True)
    def gyremedia_after_eval(self, state: TrainState, step: int, result: EvalResult, metrics: dict[str, float]) -> None:
        self.on_eval(step, result, metrics, state.backbone, state.config.core.rollout.guidance_scale)

    def on_eval(
        self, step: int, result: EvalResult, metrics: dict[str, float], backbone: Any, guidance_scale: float
    ) -> None:
        """Add the gold scores, drift and warnings for the evaluation at ``step`` to ``metrics``."""
        for key, values in score(
            self.gold, result.media, result.prompts, self.selected, f"in the step-{step} evaluation"
        ).items():
            result.scores[f"gold/{key}"] = values  # per sample, for the run's paired base-vs-trained changes
            metrics[f"eval/gold/{key}"] = summary(key, values)
        if self.settings.drift:
            metrics["eval/drift"] = backbone.reference_drift(
                result.prompts,
                result.generated,
                levels=self.settings.drift_levels,
                guidance_scale=guidance_scale,
                preference=result.preference,
            )
        current = {k: v for k, v in metrics.items() if k == self.proxy or k.startswith("eval/gold/")}
        if self.gold:
            metrics["monitor/hacking"] = float(self._hacking(step, current))
        diversity = metrics.get("eval/diversity", math.nan)
        if self.first_diversity is None:
            self.first_diversity = diversity
        collapsed = diversity < self.settings.min_diversity * self.first_diversity
        if collapsed:
            logger.warning(
                "in-group diversity at step %d is %.3f, below %.0f%% of the first evaluation's %.3f: mode collapse?",
                step,
                diversity,
                100 * self.settings.min_diversity,
                self.first_diversity,
            )
        metrics["monitor/collapse"] = float(collapsed)
        self.previous = current

    def _hacking(self, step: int, current: dict[str, float]) -> bool:
        if self.previous is None:
            return False
        gold = [k for k in current if k.startswith("eval/gold/")]
        warning = hacking_warning(step, self.previous, current, self.proxy, gold, self.settings.tolerance)
        if warning:
            logger.warning(warning)
        return warning is not None

    def state_dict(self) -> dict:
        return {"previous": self.previous, "first_diversity": self.first_diversity}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.previous, self.first_diversity = state["previous"], state["first_diversity"]
