"""Reopening a finished (or interrupted) run folder: its config, its components, its trained weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from gyremedia import checkpoint as ckpt
from gyremedia.config import ConfigError, ResolvedConfig, load_config, resolve_config
from gyremedia.interfaces import BuildContext
from gyremedia.plugins import PluginManager

RESOLVED_CONFIG = "config.yaml"
EXPORT_DIR = "pipeline"
CHANGES_FILE = "heldout_changes.json"  # every eval score, last step minus step 0, with paired intervals


def run_config(run_dir: Path, overrides: list[str], pm: PluginManager) -> ResolvedConfig:
    """The resolved config a run folder was trained with, plus ``key=value`` overrides."""
    path = Path(run_dir) / RESOLVED_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {RESOLVED_CONFIG} there; is it a run folder?")
    return resolve_config(load_config(path, [f"run.output_dir={run_dir}", *overrides]), pm)


def quiet_libraries() -> None:
    """Silence what diffusers and transformers print that says nothing to a gyremedia user: a progress bar per
    file loaded or written, and notices such as "text_encoder_3=None ... cannot be saved" at every export."""
    import diffusers
    import transformers

    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()


def default_device() -> torch.device:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator or torch.device("cpu")


def load_trained_weights(backbone: Any, run_dir: Path, checkpoint: Path | None = None) -> Path:
    """Load a checkpoint's trained weights (default: the run's latest complete one) into ``backbone``."""
    checkpoint = checkpoint or ckpt.latest_checkpoint(Path(run_dir))
    if checkpoint is None:
        raise ConfigError(f"{run_dir}: no complete checkpoint to load")
    backbone.load_trainable_state_dict(load_file(str(Path(checkpoint) / ckpt.WEIGHTS)))
    return checkpoint


def _context(config: ResolvedConfig, device: torch.device | None) -> BuildContext:
    return BuildContext(device=device or default_device(), seed=config.core.run.seed,
                        mixed_precision=config.core.train.mixed_precision)


def build_backbone(config: ResolvedConfig, pm: PluginManager, device: torch.device | None = None) -> Any:
    return pm.build(config.backbone, _context(config, device))


def build_scoring(config: ResolvedConfig, pm: PluginManager, device: torch.device | None = None) -> tuple[Any, dict[str, Any]]:
    """The evaluation sampler and the rewards of a run, its held-out gold rewards (``monitor.gold``)
    named ``gold/<name>``."""
    context = _context(config, device)
    chosen = config.eval_sampler or config.sampler
    sampler = pm.build(chosen, context) if chosen is not None else None  # a token policy samples itself
    rewards = {s.name: pm.build(s, context) for s in config.rewards}
    return sampler, {**rewards, **{f"gold/{s.name}": pm.build(s, context) for s in config.gold_rewards}}
