"""Reopening a finished (or interrupted) run folder: its config, its components, its trained weights."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from gyremedia.config import ConfigError, ResolvedConfig, load_config, resolve_config
from gyremedia.interfaces import BuildContext
from gyremedia.registry import PluginHost
from gyremedia.runtime import checkpoint as ckpt

logger = logging.getLogger("gyremedia")

RESOLVED_CONFIG = "config.yaml"
EXPORT_DIR = "pipeline"
CHANGES_FILE = "heldout_changes.json"  # every eval score, last step minus step 0, with paired intervals

#: Settings a resumed run may change freely (a key, or a section and everything under it): they decide how long
#: it runs, what it reports, how often it saves and where its folder is, never what it trains. Any other change
#: is refused unless the command names it with ``--override-resumed KEY`` (docs/errors.md).
RESUMABLE_SETTINGS = (
    "train.steps",
    "eval",
    "logging",
    "checkpoint.every",
    "checkpoint.keep_last",
    "checkpoint.max_lost_seconds",
    "export",
    "run.output_dir",
)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.0.c": leaf}`` for a nested yaml value (an empty list or dict is a leaf)."""
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value:
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _covers(key: str, names: tuple[str, ...] | list[str]) -> bool:
    return any(key == name or key.startswith(name + ".") for name in names)


def changed_settings(saved_yaml: str, config: ResolvedConfig, overridden: list[str], source: Path) -> list[str]:
    """Refuse a resume whose settings differ from those ``source`` (a checkpoint) was trained with, except
    :data:`RESUMABLE_SETTINGS` and the keys (or sections) in ``overridden``; returns the changed keys that apply.

    Raises :class:`ConfigError` with one line per refused key."""
    saved, new = (_flat(OmegaConf.to_container(OmegaConf.create(text))) for text in (saved_yaml, config.to_yaml()))
    # An option one config lacks inside a section both have was added to (or removed from) gyremedia since the run
    # was written: it is not a change of the run's (an added or removed section, e.g. a second reward, still is).
    sections = [{k.rpartition(".")[0] for k in flat} for flat in (saved, new)]
    versions = {k for k in saved.keys() ^ new.keys() if all(k.rpartition(".")[0] in s for s in sections)}
    changed = sorted(
        k for k in (saved.keys() | new.keys()) - versions if saved.get(k, "(unset)") != new.get(k, "(unset)")
    )
    refused = [k for k in changed if not _covers(k, RESUMABLE_SETTINGS) and not _covers(k, overridden)]
    if refused:
        errors = [
            f"{k}={new.get(k, '(unset)')!r} differs from the {saved.get(k, '(unset)')!r} the run was trained "
            f"with ({source}): a resumed run keeps its settings; to change it anyway, add "
            f"--override-resumed {k}"
            for k in refused
        ]
        raise ConfigError(
            errors[0]
            if len(errors) == 1
            else f"{len(errors)} settings differ from the resumed run's:\n  - " + "\n  - ".join(errors)
        )
    return [k for k in changed if _covers(k, overridden)]


def run_config(run_dir: Path, overrides: list[str], pm: PluginHost) -> ResolvedConfig:
    """The resolved config a run folder was trained with, plus ``key=value`` overrides. A ``config.yaml`` that
    does not parse (cut short by a crash before it was written atomically) gives way, with a warning, to the copy
    the newest checkpoint keeps."""
    path = Path(run_dir) / RESOLVED_CONFIG
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {RESOLVED_CONFIG} there; is it a run folder?")
    overrides = [f"run.output_dir={run_dir}", *overrides]
    try:
        OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - whatever a cut-off yaml raises
        newest = ckpt.latest_checkpoint(Path(run_dir), warn=False)
        if newest is None or ckpt.saved_config(newest) is None:
            raise ConfigError(
                f"{path} does not parse ({type(exc).__name__}), and no checkpoint keeps a copy of the "
                "config: restore it, or start a new run (run.output_dir)"
            ) from exc
        logger.warning("%s does not parse (%s): using the copy in %s", path, type(exc).__name__, newest)
        path = newest / ckpt.CONFIG
    return resolve_config(load_config(path, overrides), pm)


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


def check_export_folder(out_dir: Path, run_dir: Path, overwrite: bool) -> None:
    """Refuse an export into the run folder or a folder holding it (an export replaces its folder whole), and,
    unless ``overwrite``, into a folder that holds anything (stale files would mix with the new model's)."""
    out, run = Path(out_dir).resolve(), Path(run_dir).resolve()
    if out == run or out in run.parents:
        raise ConfigError(
            f"{out_dir} holds the run folder {run_dir}: export into a folder of its own (an export "
            "replaces its folder whole)"
        )
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"{out_dir} is not empty: export into a new folder, or add --overwrite to replace what it holds"
        )


def export_whole(backbone: Any, out_dir: Path, *, merge_lora: bool) -> None:
    """``backbone.save_pretrained`` into a sibling temporary folder, then renamed into place: ``out_dir`` holds a
    whole export, or what it held before (a crash midway leaves only the hidden temporary folder). What was in
    ``out_dir`` is replaced whole, never mixed with the new files."""
    out = Path(out_dir)
    out = out if out.name else out.absolute()  # "." has no name to put a sibling beside
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(f".{out.name}.export-tmp"), out.with_name(f".{out.name}.export-old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        backbone.save_pretrained(tmp, merge_lora=merge_lora)
        readme = tmp / "README.md"  # its loading snippet names the folder it was written to
        if readme.is_file():
            readme.write_text(readme.read_text().replace(str(tmp), str(out)))
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _context(config: ResolvedConfig, device: torch.device | None) -> BuildContext:
    return BuildContext(
        device=device or default_device(), seed=config.core.run.seed, mixed_precision=config.core.train.mixed_precision
    )


def build_backbone(config: ResolvedConfig, pm: PluginHost, device: torch.device | None = None) -> Any:
    return pm.build(config.backbone, _context(config, device))


def build_scoring(
    config: ResolvedConfig, pm: PluginHost, device: torch.device | None = None
) -> tuple[Any, dict[str, Any]]:
    """The evaluation sampler and the rewards of a run, its held-out gold rewards (``monitor.gold``)
    named ``gold/<name>``."""
    context = _context(config, device)
    chosen = config.eval_sampler or config.sampler
    sampler = pm.build(chosen, context) if chosen is not None else None  # a token policy samples itself
    rewards = {s.name: pm.build(s, context) for s in config.rewards}
    return sampler, {**rewards, **{f"gold/{s.name}": pm.build(s, context) for s in config.gold_rewards}}
