"""The scoring stage: decode a rollout, hand its media to the rewards' worker threads, collect their scores."""

from __future__ import annotations

import collections
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.rollout import Rollout
from gyremedia.runtime.distributed import global_nanmeans, raise_together
from gyremedia.scoring import FRAME_SCORES, RewardError, reward_error
from gyremedia.stages.advantages import weighted_rewards
from gyremedia.state import TrainState

#: Steps over which a reward's share of dropped samples is measured against its ``max_dropped``.
DROP_WINDOW = 10


def start_scoring(state: TrainState, rollout: Rollout) -> dict[str, Any]:
    """Decode the rollout and hand its media to the rewards' worker threads; returns at once. A rollout that
    arrives scored (its rewards set by the rollout stage: saved rollouts, ``data.offline``) is not scored again."""
    rollout.media = state.backbone.media(rollout)
    return {} if rollout.rewards else state.scorer.submit(rollout.media, rollout.prompts)


def _collect_scores(state: TrainState, rollout: Rollout, step: int, futures: dict[str, Any]) -> dict[str, Any]:
    """Wait for this process's rewards (failure policies applied) into ``rollout.rewards``; per-sample metrics."""
    per_sample, dropped = {}, torch.zeros(len(rollout), dtype=torch.bool)
    scored = state.scorer.collect(futures, rollout.prompts, step)
    for name, scores in scored.components.items():
        rollout.rewards[name] = scores.pop("score").to(state.accelerator.device)
        if FRAME_SCORES in scores:
            rollout.frame_rewards[name] = scores.pop(FRAME_SCORES).to(state.accelerator.device)
        dropped |= scored.dropped[name]
        per_sample.update({f"reward/{name}/{k}": v for k, v in scores.items()})
        if state.scorer.may_drop(name):
            per_sample[f"reward/{name}/dropped"] = scored.dropped[name].float()
    state.plugins.hook.gyremedia_process_rewards(state=state, rollout=rollout, rewards=rollout.rewards)
    for name, values in rollout.rewards.items():
        bad = (~torch.isfinite(values.cpu()) & ~dropped).nonzero().flatten()
        if len(bad):
            raise reward_error(
                name,
                step,
                rollout.prompts,
                f"the score after gyremedia_process_rewards is {values[bad[0]].item()}",
                int(bad[0]),
            )
    return per_sample


@hookimpl(trylast=True)
def gyremedia_score_rollout(
    state: TrainState, rollout: Rollout, futures: dict[str, Any], step: int
) -> dict[str, float]:
    """Wait for every reward (failure policies applied); set ``rollout.rewards`` and ``rollout.reward``."""
    acc, per_sample, error = state.accelerator, {}, None
    try:  # this process's rewards; a failure here stops every process (raise_together), not this one alone
        per_sample = _collect_scores(state, rollout, step, futures) if futures else {}
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
        error = exc
    raise_together(acc, error)
    matrix, weights = weighted_rewards(state.config, rollout)
    rollout.reward = (matrix * weights.to(matrix.device)).sum(dim=1)
    per_sample.update({f"reward/{name}": v for name, v in rollout.rewards.items()})
    metrics = global_nanmeans(acc, per_sample)
    for key in [k for k in metrics if k.endswith("/dropped")]:
        metrics[key] *= state.config.core.rollout.batch_size  # a count over the whole batch, not a share
    stop_if_dropping_too_many(state, metrics, step)
    return metrics


def stop_if_dropping_too_many(state: TrainState, metrics: dict[str, float], step: int) -> None:
    """Stop (every process alike: the counts are global) when a reward with ``on_failure: drop`` dropped more
    than its ``max_dropped`` share of the samples over the last :data:`DROP_WINDOW` steps: a reward server that
    is down would otherwise drop every sample while the weights still move (momentum, weight decay)."""
    batch = state.config.core.rollout.batch_size
    for i, selected in enumerate(state.config.rewards):
        count = metrics.get(f"reward/{selected.name}/dropped")
        if count is None:
            continue
        window = state.dropped.setdefault(selected.name, collections.deque(maxlen=DROP_WINDOW))
        window.append(count)
        share = sum(window) / (len(window) * batch)
        if share > selected.settings.max_dropped:
            raise RewardError(
                f"reward {selected.name!r} dropped {sum(window):.0f} of {len(window) * batch} "
                f"samples over the last {len(window)} step(s) up to step {step}, more than "
                f"rewards.{i}.max_dropped={selected.settings.max_dropped} allows: is it reachable (a server down?); "
                f"raise max_dropped to train on through such failures"
            )
