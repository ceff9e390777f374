"""ParetoSlider: one model conditioned on reward-preference weights instead of a fixed weighted sum.

Each prompt group of a step draws its weights from a Dirichlet (``pareto.concentration``); the advantages
weigh the rewards by them (``Rollout.preference``) and the backbone is conditioned on them. After the last
step the trained model is evaluated at ``pareto.sweep`` weight settings: the front, in ``pareto_front.json``
and ``pareto_front.png``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gyremedia import evaluation, hookimpl
from gyremedia.config import ResolvedConfig
from gyremedia.interfaces import BuildContext, RolloutRequest
from gyremedia.media_io import plot_pareto_front
from gyremedia.runtime.streams import Stream, stream_rng
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


def preference_weights(seed: int, step: int, group_ids: torch.Tensor, count: int, concentration: float) -> torch.Tensor:
    """``[B, count]`` reward-preference weights, one Dirichlet draw per group keyed by ``(seed, step, group)``
    (the same on any number of processes)."""
    rows = {
        g: stream_rng(seed, step, Stream.PREFERENCE, g).dirichlet([concentration] * count)
        for g in group_ids.unique().tolist()
    }
    return torch.tensor(np.stack([rows[g] for g in group_ids.tolist()]), dtype=torch.float32)


def sweep_weights(count: int, settings: int) -> torch.Tensor:
    """Preference weights a Pareto front is evaluated at: for two rewards ``settings`` points from
    ``(1, 0)`` to ``(0, 1)``; for more, each reward alone and the equal mix."""
    if count == 2:
        a = torch.linspace(0, 1, settings)
        return torch.stack([1 - a, a], dim=1)
    return torch.cat([torch.eye(count), torch.full((1, count), 1 / count)])


def pareto_front(config: ResolvedConfig, backbone: Any, sampler: Any, rewards: dict[str, Any]) -> list[dict[str, Any]]:
    """One evaluation per swept weight setting: ``[{"weights": [...], "<reward>": mean score, ...}]``."""
    front = []
    for weights in tqdm(
        sweep_weights(len(config.rewards), config.core.pareto.sweep),
        desc="pareto front",
        disable=not config.core.logging.progress,
    ):
        result = evaluation.evaluate(config, backbone, sampler, rewards, preference=weights)
        front.append(
            {
                "weights": [round(float(w), 4) for w in weights],
                **{s.name: evaluation.nanmean(result.scores[s.name]) for s in config.rewards},
            }
        )
    return front


@hookimpl
def gyremedia_eval_preference(config: ResolvedConfig) -> torch.Tensor | None:
    """A Pareto run's model is evaluated at equal weights (its front at the swept ones)."""
    if not config.core.pareto.enabled:
        return None
    return torch.full((len(config.rewards),), 1 / len(config.rewards))


@hookimpl
def gyremedia_eval_report(
    config: ResolvedConfig, backbone: Any, sampler: Any, rewards: dict[str, Any], report: dict[str, Any]
) -> list[str] | None:
    """``gyremedia eval``: the trained model at each swept preference."""
    if not config.core.pareto.enabled:
        return None
    report["pareto_front"] = front = pareto_front(config, backbone, sampler, rewards)
    return [
        f"preference {point['weights']}: " + ", ".join(f"{s.name} {point[s.name]:.4f}" for s in config.rewards)
        for point in front
    ]


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    """A Pareto run needs several rewards and a backbone that takes one preference input per reward."""
    if not core.pareto.enabled:
        return []
    rewards, backbone, errors = selected.get("rewards") or [], selected.get("backbone"), []
    if len(rewards) < 2:
        errors.append("pareto.enabled needs at least 2 rewards to weigh against each other")
    if backbone is not None:
        inputs = getattr(backbone.options, "preference_inputs", None)
        if inputs is None:
            errors.append(f"pareto.enabled: backbone {backbone.name!r} cannot be conditioned on preference weights")
        elif inputs != len(rewards):
            errors.append(
                f"pareto.enabled with {len(rewards)} rewards: set backbone.preference_inputs={len(rewards)} "
                f"(it is {inputs})"
            )
    return errors


@hookimpl
def gyremedia_setup(state: TrainState, context: BuildContext) -> None:
    if state.config.core.pareto.enabled:
        state.plugins.register_for_run(ParetoPreferences(), name="pareto:run")


class ParetoPreferences:
    """A run's preference draws, and its front once trained."""

    def __init__(self) -> None:
        self.base: dict[str, float] | None = None  # the step-0 evaluation (not kept across a resume)

    @hookimpl(tryfirst=True)
    def gyremedia_prepare_request(self, state: TrainState, request: RolloutRequest) -> None:
        core = state.config.core
        request.preference = preference_weights(
            core.run.seed, request.step, request.group_ids, len(state.config.rewards), core.pareto.concentration
        )

    @hookimpl
    def gyremedia_after_eval(self, state: TrainState, step: int, result: Any, metrics: dict[str, float]) -> None:
        if step == 0:
            self.base = metrics
        if step == state.config.core.train.steps:
            metrics.update(self.front(state))

    def front(self, state: TrainState) -> dict[str, float]:
        """Sweep the preference weights of the trained model; the main process writes the front (json, plot)."""
        config = state.config
        front = pareto_front(config, state.backbone, state.eval_sampler, state.rewards)
        names = [s.name for s in config.rewards]
        if state.accelerator.is_main_process:
            (state.run_dir / "pareto_front.json").write_text(json.dumps(front, indent=1))
            base = self.base
            plot_pareto_front(
                front,
                names,
                state.run_dir / "pareto_front.png",
                base={n: base[f"eval/{n}"] for n in names} if base else None,
            )
            logger.info(
                "pareto front: %s",
                "; ".join(f"{p['weights']}: " + ", ".join(f"{n} {p[n]:.3f}" for n in names) for p in front),
            )
        return {f"pareto/{i}/{name}": point[name] for i, point in enumerate(front) for name in names}
