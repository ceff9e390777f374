"""``data.offline``: train on rollouts sampled and scored once (``gyremedia rollout``, :mod:`gyremedia.offline`).

The rollout stage is taken over: step ``k`` gets saved step ``k mod steps``, this process's rows of it (the rows
whose sample ids the step's request names, so any number of processes reads a folder written by any other), with
its saved rewards, which the scoring stage keeps. Nothing is sampled and no reward runs during training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gyremedia import hookimpl
from gyremedia.interfaces import RolloutRequest
from gyremedia.offline import Manifest, load_step
from gyremedia.rollout import Rollout
from gyremedia.state import TrainState


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    folder = core.data.offline
    if folder is None:
        return []
    try:
        manifest = Manifest.read(Path(folder))
    except (FileNotFoundError, TypeError, ValueError) as exc:
        return [f"data.offline: {exc}"]
    errors, fix = [], f"or write the rollouts again with this config (gyremedia rollout CONFIG --out {folder})"
    for key in ("batch_size", "group_size"):
        if getattr(core.rollout, key) != getattr(manifest, key):
            errors.append(
                f"data.offline: the saved steps have rollout.{key}={getattr(manifest, key)}: set "
                f"rollout.{key}={getattr(manifest, key)}, {fix}"
            )
    missing = [s.name for s in selected.get("rewards") or [] if s is not None and s.name not in manifest.rewards]
    if missing:
        errors.append(
            f"data.offline: the saved samples were not scored by {', '.join(missing)} (they were by "
            f"{', '.join(manifest.rewards)}): use those rewards, {fix}"
        )
    objective = selected.get("objective")
    if objective is not None and objective.meta.get("requires_log_prob") and not manifest.trajectories:
        errors.append(
            f"data.offline: objective {objective.name!r} replays transitions, and {folder} holds final samples "
            "only: write it with `gyremedia rollout --trajectories`, or train a forward-process objective (gdro)"
        )
    return errors


@hookimpl
def gyremedia_setup(state: TrainState, context: Any) -> None:
    folder = state.config.core.data.offline
    if folder is not None:
        state.plugins.register_for_run(SavedRollouts(Path(folder)), name="offline:run")


class SavedRollouts:
    """Serves each step a saved, scored rollout (the last one loaded is kept: a step's ranks share it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.manifest = Manifest.read(folder)
        self._loaded: tuple[int, Rollout] | None = None

    @hookimpl(tryfirst=True)
    def gyremedia_collect_rollout(self, state: TrainState, request: RolloutRequest) -> Rollout:
        saved_step = request.step % self.manifest.steps
        if self._loaded is None or self._loaded[0] != saved_step:
            self._loaded = (saved_step, load_step(self.folder, self.manifest, saved_step))
        saved = self._loaded[1]
        position = {int(sample_id): row for row, sample_id in enumerate(saved.sample_ids.tolist())}
        rows = [position[int(sample_id)] for sample_id in request.sample_ids]
        device = state.accelerator.device
        mine = saved.select(rows)
        mine.conditions = {k: v.to(device) for k, v in mine.conditions.items()}
        mine.states = mine.states.to(device)
        mine.rewards = {k: v.to(device) for k, v in mine.rewards.items()}
        if mine.log_probs is not None:
            mine.log_probs = mine.log_probs.to(device)
        return mine
