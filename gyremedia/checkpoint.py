"""Atomic, verified checkpoints: a run killed at any moment resumes from its last complete checkpoint.

A checkpoint is written into a hidden temporary folder, every file flushed to disk, and renamed into
place only once every rank has written its part, so ``checkpoints/step-NNNNNN`` either exists whole or
not at all. Its ``manifest.json`` (written last, beside ``trainer_state.json``) records every file's
size: on a filesystem without atomic renames, or after a bad disk, a checkpoint whose files do not
match it, or that fails to load, is skipped with a warning and the previous one is used.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load, save

logger = logging.getLogger("gyremedia")

CHECKPOINT_DIR = "checkpoints"
WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"
COMPONENTS = "components.pt"  # tensors of stateful components (an objective's old policy, ...)
MANIFEST = "manifest.json"  # {file name: size in bytes} of every other file, written last


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the message names the folder."""


class CorruptCheckpoint(RuntimeError):
    """A checkpoint on disk is incomplete or unreadable."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run that finished writing (renamed into place), oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / TRAINER_STATE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest (a damaged newer one is skipped with a warning)."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
            return path
        except CorruptCheckpoint as exc:
            logger.warning("skipping damaged checkpoint %s: %s", path, exc)
    return None


def verify(path: Path) -> None:
    """Raise :class:`CorruptCheckpoint` unless every file the manifest lists is there with its size."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"its {MANIFEST} is missing or unreadable ({exc})") from exc
    for name, size in manifest.items():
        file = Path(path) / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if file.stat().st_size != size:
            raise CorruptCheckpoint(f"{name} has {file.stat().st_size} bytes, the manifest says {size}")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write(path: Path, data: bytes) -> None:
    """Write a file and flush it to the disk (so a rename after it never publishes a half-written file)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _all_ranks_ok(accelerator, ok: bool) -> bool:
    """Whether every rank succeeded (one collective), so no rank waits at a barrier another never reaches."""
    if accelerator.num_processes == 1:
        return ok
    flags = accelerator.gather(torch.tensor([float(ok)], device=accelerator.device))
    return bool(flags.min().item() > 0)


def save_checkpoint(accelerator, run_dir: Path, step: int, *, weights: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any], scheduler, plugin_state: Callable[[Path], dict[str, Any]],
                    keep_last: int, component_state: dict[str, Any] | None = None, sharded: bool = False) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this) and prune old ones on the main rank.

    ``weights`` and ``optimizer_state`` are the main rank's (whole, also when the model is ``sharded``:
    then the optimizer state is keyed by parameter name).

    ``plugin_state(folder)`` is called on every rank with the folder being written and returns the
    plugins' JSON state (the main rank's is kept). A write that fails on any rank (disk full,
    permissions) removes the temporary folder and raises :class:`CheckpointError` on every rank; the
    previous checkpoints stay as they were.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    error: OSError | None = None
    if accelerator.is_main_process:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    accelerator.wait_for_everyone()
    try:
        if error is None and not tmp.is_dir():
            raise FileNotFoundError(f"{tmp} is not visible on rank {accelerator.process_index}")
        if error is None:
            _write(tmp / f"rng_rank{accelerator.process_index}.pt", _torch_bytes(rng_state()))
            plugins = plugin_state(tmp)
            if accelerator.is_main_process:
                _write(tmp / WEIGHTS, save({k: v.detach().contiguous().cpu() for k, v in weights.items()}))
                _write(tmp / OPTIMIZER, _torch_bytes(optimizer_state))
                _write(tmp / SCHEDULER, _torch_bytes(scheduler.state_dict()))
                if component_state:
                    _write(tmp / COMPONENTS, _torch_bytes(component_state))
    except OSError as exc:
        error = exc
    _stop_unless_written(accelerator, error, tmp, step)
    if accelerator.is_main_process:
        try:
            state = {"step": step, "num_processes": accelerator.num_processes, "sharded": sharded, "plugins": plugins}
            _write(tmp / TRAINER_STATE, json.dumps(state, indent=2).encode())
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
            _write(tmp / MANIFEST, json.dumps(sizes, indent=1).encode())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except OSError as exc:
            error = exc
    _stop_unless_written(accelerator, error, tmp, step)
    if accelerator.is_main_process:
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _stop_unless_written(accelerator, error: OSError | None, tmp: Path, step: int) -> None:
    """On every rank: raise :class:`CheckpointError` (after removing the temporary folder) if any rank failed."""
    if _all_ranks_ok(accelerator, error is None):
        return
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    why = f"{type(error).__name__}: {error.strerror or error}" if error is not None else "another process failed to write"
    raise CheckpointError(f"could not write checkpoint {checkpoint_name(step)} in {tmp.parent} ({why}): free disk space "
                          "or fix the folder's permissions (run.output_dir); the previous checkpoints are intact")


@dataclass
class LoadedCheckpoint:
    """Everything read from one checkpoint folder, checked before any of it is applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    state: dict[str, Any]  # trainer_state.json, plus "components"
    rng: dict[str, Any] | None


def read_checkpoint(accelerator, path: Path) -> LoadedCheckpoint:
    """Read a checkpoint (this rank's RNG included); raise :class:`CorruptCheckpoint` if any part fails."""
    path = Path(path)
    verify(path)
    # torch.load restores no indexed CPU device, which accelerate names its gloo processes' device (cpu:0)
    device = torch.device("cpu") if accelerator.device.type == "cpu" else accelerator.device
    try:
        weights = load((path / WEIGHTS).read_bytes())
        weights = {k: v.to(device) for k, v in weights.items()}
        # on the CPU: load_state_dict moves each state to its parameter's device; a sharded run's (whole) state
        # must not land whole on every accelerator
        optimizer = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=False)
        scheduler = torch.load(path / SCHEDULER, weights_only=False)
        state = json.loads((path / TRAINER_STATE).read_text())
        components = path / COMPONENTS
        state["components"] = torch.load(components, map_location=device) if components.is_file() else {}
        rng_file = path / f"rng_rank{accelerator.process_index}.pt"
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises, the checkpoint is unusable
        raise CorruptCheckpoint(f"{type(exc).__name__}: {exc}") from exc
    return LoadedCheckpoint(path, weights, optimizer, scheduler, state, rng)


def read_latest_checkpoint(accelerator, run_dir: Path) -> LoadedCheckpoint | None:
    """The newest checkpoint that every rank reads whole; damaged newer ones are skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            loaded, error = read_checkpoint(accelerator, path), None
        except CorruptCheckpoint as exc:
            loaded, error = None, exc
        if _all_ranks_ok(accelerator, loaded is not None):
            return loaded
        logger.warning("skipping damaged checkpoint %s (%s): resuming from the one before", path,
                       error or "unreadable on another rank")
    return None


def apply_checkpoint(loaded: LoadedCheckpoint, *, load_optimizer: Callable[[dict[str, Any]], None], scheduler,
                     process_index: int) -> None:
    """Restore the optimizer (through ``load_optimizer``), the LR schedule and this rank's RNG from a
    checkpoint that was read whole."""
    load_optimizer(loaded.optimizer)
    scheduler.load_state_dict(loaded.scheduler)
    if loaded.rng is not None:
        set_rng_state(loaded.rng)
    else:
        logger.warning("%s has no RNG state for rank %d (saved with %d processes); continuing with fresh RNG",
                       loaded.path, process_index, loaded.state["num_processes"])
