"""The checkpoint stage, and resuming from one: weights, optimizer, schedule, random streams, the components'
and the features' state."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from gyremedia import hookimpl
from gyremedia.config import ConfigError, ResolvedConfig
from gyremedia.registry import call_each
from gyremedia.runtime import checkpoint as ckpt
from gyremedia.runtime import sharding
from gyremedia.runtime.runs import RESOLVED_CONFIG, changed_settings
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


def stateful_components(state: TrainState) -> dict[str, Any]:
    """Selected components with tensors to checkpoint (``state_dict``/``load_state_dict``), and the features'
    state objects (``state.stateful``), by the name their state is stored under."""
    candidates = {
        "objective": state.objective,
        "sampler": state.sampler,
        "weighting": state.weighting,
        **state.stateful,
        **{f"reward/{k}": v for k, v in state.rewards.items()},
        **{f"regularizer/{k}": v for k, v in state.regularizers.items()},
    }
    return {
        name: c
        for name, c in candidates.items()
        if callable(getattr(c, "state_dict", None)) and callable(getattr(c, "load_state_dict", None))
    }


@hookimpl(trylast=True)
def gyremedia_save_checkpoint(state: TrainState) -> Path:
    """Checkpoint the current step (every rank); plugins' hooks see the folder being written."""

    def plugin_state(folder: Path) -> dict[str, Any]:
        return {
            k: v
            for k, v in call_each(state.plugins.pm, "gyremedia_on_save_checkpoint", state=state, path=folder).items()
            if v is not None
        }

    # sharded, both are collectives that give the whole state to the main process
    optimizer_state = (
        sharding.full_optimizer_state_dict(state.trained_module, state.optimizer)
        if state.sharded
        else state.optimizer.state_dict()
    )
    core = state.config.core
    path = ckpt.save_checkpoint(
        state.accelerator,
        state.run_dir,
        state.step,
        weights=state.backbone.trainable_state_dict(),
        optimizer_state=optimizer_state,
        scheduler=state.lr_scheduler,
        plugin_state=plugin_state,
        keep_last=core.checkpoint.keep_last,
        sharded=state.sharded,
        config_yaml=state.config.to_yaml(),
        component_state={name: c.state_dict() for name, c in stateful_components(state).items()},
    )
    state.last_save = (state.step, time.monotonic())
    return path


def check_resumed_settings(run_dir: Path, config: ResolvedConfig, overridden: list[str] | tuple[str, ...]) -> None:
    """Before any model loads: refuse settings that differ from those the newest checkpoint was trained with
    (see :func:`gyremedia.runtime.runs.changed_settings`), except those ``overridden`` lets through."""
    newest = ckpt.latest_checkpoint(run_dir, warn=False)
    saved = ckpt.saved_config(newest) if newest is not None else None
    source = newest
    if saved is None and (run_dir / RESOLVED_CONFIG).is_file():  # a checkpoint written before 2026-12
        saved, source = (run_dir / RESOLVED_CONFIG).read_text(), run_dir / RESOLVED_CONFIG
    if saved is None or source is None:
        return
    changed = changed_settings(saved, config, list(overridden), source)
    if changed:
        logger.warning("resuming with changed settings (--override-resumed): %s", ", ".join(changed))


def read_checkpoint(state: TrainState) -> ckpt.LoadedCheckpoint | None:
    """The newest checkpoint that reads whole (damaged newer ones are skipped, with a warning)."""
    loaded = ckpt.read_latest_checkpoint(state.accelerator, state.run_dir)
    if loaded is None:  # stopped before its first checkpoint (a run whose checkpoints are all damaged raises)
        logger.warning("no checkpoint in %s yet: starting from step 0", state.run_dir)
    elif bool(loaded.state.get("sharded", False)) != state.sharded:
        saved = "sharded" if loaded.state.get("sharded") else "unsharded"
        how = (
            f"on {loaded.state['num_processes']} processes with train.sharding=fsdp2"
            if loaded.state.get("sharded")
            else "with train.sharding=none"
        )
        raise ConfigError(
            f"{loaded.path} was written by a {saved} run (its optimizer state is laid out for it): resume it {how}"
        )
    return loaded


def resume(state: TrainState, loaded: ckpt.LoadedCheckpoint) -> None:
    """Continue from a checkpoint whose weights are already in the backbone."""

    def load_optimizer(saved: dict[str, Any]) -> None:
        if state.sharded:
            sharding.load_full_optimizer_state_dict(state.trained_module, state.optimizer, saved)
        else:
            state.optimizer.load_state_dict(saved)

    ckpt.apply_checkpoint(
        loaded,
        load_optimizer=load_optimizer,
        scheduler=state.lr_scheduler,
        process_index=state.accelerator.process_index,
    )
    apply_optimizer_settings(state)
    for name, component in stateful_components(state).items():
        component.load_state_dict(loaded.state["components"].get(name, {}))
    state.step = loaded.state["step"]
    state.plugins.hook.gyremedia_on_load_checkpoint(
        state=state, path=loaded.path, plugin_state=loaded.state.get("plugins", {})
    )
    logger.info("resumed from %s at step %d", loaded.path, state.step)


def apply_optimizer_settings(state: TrainState) -> None:
    """The config's AdamW settings and LR schedule over the restored optimizer state (which carries the ones
    it was saved with): unchanged, this rewrites the same values; changed with ``--override-resumed``, the new
    ones apply from the restored step on."""
    train, optimizer, schedule = state.config.core.train, state.optimizer, state.lr_scheduler
    schedule.base_lrs = [train.learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):
        group.update(
            initial_lr=train.learning_rate,
            lr=train.learning_rate * factor(schedule.last_epoch),
            betas=(train.adam_beta1, train.adam_beta2),
            weight_decay=train.weight_decay,
        )
    schedule._last_lr = [group["lr"] for group in optimizer.param_groups]
