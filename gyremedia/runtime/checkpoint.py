"""Atomic, verified checkpoints: a run killed at any moment resumes from its last complete checkpoint.

A checkpoint is written into a hidden temporary folder, every file flushed to disk, and renamed into
place only once every rank has written its part, so ``checkpoints/step-NNNNNN`` either exists whole or
not at all. Its ``manifest.json`` (written last, beside ``trainer_state.json``) records every file's
size: on a filesystem without atomic renames, or after a bad disk, a checkpoint whose files do not
match it, or that fails to load, is set aside into ``checkpoints/damaged/`` (never deleted) with a warning and
the previous one is used; old checkpoints are pruned only among verified ones, by step number.

Everything is read back with ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain values
(numbers, strings, lists, dicts) only, checked when it is written, so loading a downloaded run folder runs no
code. Each checkpoint also keeps the resolved config it was trained with (``config.yaml``), which a resume
compares with the one it is given.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load, save

from gyremedia.runtime.distributed import any_rank, largest_on_any_rank, raise_together

logger = logging.getLogger("gyremedia")

CHECKPOINT_DIR = "checkpoints"
WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"
COMPONENTS = "components.pt"  # tensors of stateful components (an objective's old policy, ...)
CONFIG = "config.yaml"  # the resolved config the run had when it wrote the checkpoint
MANIFEST = "manifest.json"  # {file name: size in bytes} of every other file, written last
DAMAGED_DIR = "damaged"  # inside checkpoints/: damaged checkpoints, moved aside rather than deleted
_STEP = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions) or read; the message names the folder."""

    exit_code = 1


class CorruptCheckpoint(RuntimeError):
    """A checkpoint on disk is incomplete or unreadable."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file holds Python objects other than tensors and plain values: it is refused, not run."""


class NoUsableCheckpoint(CheckpointError):
    """Every checkpoint of a run folder is damaged: a resume stops rather than start again from step 0."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder ``step-N`` holds (its number, not its name: step 1,000,000 sorts last)."""
    match = _STEP.fullmatch(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (step-N)")
    return int(match.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint folders of a run (renamed into place; not yet verified), oldest step first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)), key=checkpoint_step)


def latest_checkpoint(run_dir: Path, warn: bool = True) -> Path | None:
    """The newest checkpoint whose files match its manifest (a damaged newer one is skipped, with a warning).

    Read-only (``eval``, ``export``): a damaged checkpoint is left where it is."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
            return path
        except CorruptCheckpoint as exc:
            if warn:
                logger.warning("skipping damaged checkpoint %s: %s", path, exc)
    return None


def set_aside(path: Path, why: object) -> Path:
    """Move a damaged checkpoint into ``checkpoints/damaged/`` (kept for inspection, out of every listing)."""
    root = Path(path).parent / DAMAGED_DIR
    root.mkdir(exist_ok=True)
    target, n = root / Path(path).name, 1
    while target.exists():
        target, n = root / f"{Path(path).name}.{n}", n + 1
    os.replace(path, target)
    logger.warning("damaged checkpoint %s (%s) moved aside to %s", path, why, target)
    return target


def prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the ``keep_last`` newest verified checkpoints (by step number), never ``keep``; damaged
    ones are set aside, so they neither count nor make a good one go."""
    good = []
    for path in list_checkpoints(run_dir):
        try:
            verify(path)
            good.append(path)
        except CorruptCheckpoint as exc:
            set_aside(path, exc)
    for old in good[:-keep_last]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


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
    """This process's random states as tensors and plain values (``weights_only`` reads them back)."""
    name, keys, pos, has_gauss, gaussian = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    numpy = {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(gaussian),
    }
    state = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    if isinstance(numpy, dict):
        numpy = (
            numpy["name"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    np.random.set_state(numpy)  # a checkpoint written before 2026-12 holds numpy's own tuple
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write(path: Path, data: bytes) -> None:
    """Write a file and flush it to the disk (so a rename after it never publishes a half-written file)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` whole: a crash or full disk leaves the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _write(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


#: Exact types (a subclass such as numpy.float64, an IntEnum or a defaultdict is refused by the loader).
_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, tuple, dict, collections.OrderedDict)


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`CheckpointError` unless ``value`` is tensors and plain values only (what
    ``torch.load(weights_only=True)`` reads back without running code), naming ``where`` it is not."""
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _PLAIN:
        return
    if kind in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if kind in _CONTAINERS:
        for key, item in value.items():
            if type(key) not in _PLAIN:
                raise CheckpointError(f"{where} has a key of type {type(key).__name__}: {_PLAIN_ONLY}")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise CheckpointError(f"{where} is a {kind.__module__}.{kind.__qualname__}: {_PLAIN_ONLY}")


_PLAIN_ONLY = (
    "a checkpoint stores tensors, numbers, strings, lists and dicts only (it is read back with "
    "torch.load(weights_only=True), which runs no code): convert it in its state_dict"
)


def _write_state(
    tmp: Path,
    plugins: dict[str, Any],
    component_state: dict[str, Any],
    *,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler: Any,
    config_yaml: str,
) -> None:
    """The main rank's files of a checkpoint, once every state is checked to be plain values."""
    for name, value in plugins.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"plugin {name!r} returned a state from gyremedia_on_save_checkpoint "
                f"that is not JSON ({exc}): return numbers, strings, lists and dicts"
            ) from exc
    for name, value in component_state.items():
        check_plain(value, f"the state of {name}")
    _write(tmp / WEIGHTS, save({k: v.detach().contiguous().cpu() for k, v in weights.items()}))
    _write(tmp / OPTIMIZER, _torch_bytes(optimizer_state))
    _write(tmp / SCHEDULER, _torch_bytes(scheduler.state_dict()))
    _write(tmp / CONFIG, config_yaml.encode())
    if component_state:
        _write(tmp / COMPONENTS, _torch_bytes(component_state))


def _publish(tmp: Path, final: Path, trainer_state: dict[str, Any], keep_last: int) -> Exception | None:
    """Main rank: the trainer state and the manifest of sizes, the folder renamed to its final name in one step,
    then the old checkpoints pruned. Returns what failed, if anything (a failed prune is only a warning)."""
    try:
        _write(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=2).encode())
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        _write(tmp / MANIFEST, json.dumps(sizes, indent=1).encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it (a lone raise hangs the others)
        return exc
    try:  # the checkpoint is written: failing to tidy the old ones is worth a warning, not a stop
        prune(final.parent.parent, keep_last, keep=final)
    except OSError as exc:
        logger.warning("could not prune the old checkpoints in %s: %s", final.parent, exc)
    return None


def _empty_folder(accelerator: Any, tmp: Path) -> Exception | None:
    """The main rank makes ``tmp`` anew and empty; every rank waits for it. Returns what failed, if anything."""
    error: Exception | None = None
    if accelerator.is_main_process:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    accelerator.wait_for_everyone()
    return error


def save_checkpoint(
    accelerator,
    run_dir: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler,
    plugin_state: Callable[[Path], dict[str, Any]],
    keep_last: int,
    config_yaml: str,
    component_state: dict[str, Any] | None = None,
    sharded: bool = False,
) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this) and prune old ones on the main rank.

    ``weights`` and ``optimizer_state`` are the main rank's (whole, also when the model is ``sharded``:
    then the optimizer state is keyed by parameter name); ``config_yaml`` is the run's resolved config.

    ``plugin_state(folder)`` is called on every rank with the folder being written and returns the
    plugins' JSON state (the main rank's is kept). A write that fails on any rank (disk full,
    permissions, a component or plugin state that is not plain values) removes the temporary folder and
    raises :class:`CheckpointError` on every rank; the previous checkpoints stay as they were.
    """
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    error = _empty_folder(accelerator, tmp)
    plugins: dict[str, Any] = {}
    try:
        if error is None and not tmp.is_dir():
            raise FileNotFoundError(f"{tmp} is not visible on rank {accelerator.process_index}")
        if error is None:
            _write(tmp / f"rng_rank{accelerator.process_index}.pt", _torch_bytes(rng_state()))
            plugins = plugin_state(tmp)
            if accelerator.is_main_process:
                _write_state(
                    tmp,
                    plugins,
                    component_state or {},
                    weights=weights,
                    optimizer_state=optimizer_state,
                    scheduler=scheduler,
                    config_yaml=config_yaml,
                )
    except Exception as exc:  # noqa: BLE001 - whatever fails, every rank must hear of it (a lone raise hangs the others)
        error = exc
    _stop_unless_written(accelerator, error, tmp, step)
    if accelerator.is_main_process:
        state = {"step": step, "num_processes": accelerator.num_processes, "sharded": sharded, "plugins": plugins}
        error = _publish(tmp, final, state, keep_last)
    _stop_unless_written(accelerator, error, tmp, step)
    return final


def _stop_unless_written(accelerator, error: Exception | None, tmp: Path, step: int) -> None:
    """On every rank: raise :class:`CheckpointError` (after removing the temporary folder) if any rank failed."""
    if not any_rank(accelerator, error is not None)[0]:  # no rank waits at a barrier another never reaches
        return
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    where = f"could not write checkpoint {checkpoint_name(step)} in {tmp.parent}"
    if isinstance(error, CheckpointError):
        raise CheckpointError(f"{where}: {error}; the previous checkpoints are intact") from error
    if isinstance(error, OSError):
        why = f"{type(error).__name__}: {error.strerror or error}"
        raise CheckpointError(
            f"{where} ({why}): free disk space or fix the folder's permissions (run.output_dir); "
            "the previous checkpoints are intact"
        ) from error
    why = f"{type(error).__name__}: {error}" if error is not None else "another process failed to write its part"
    raise CheckpointError(f"{where} ({why}); the previous checkpoints are intact") from error


@dataclass
class LoadedCheckpoint:
    """Everything read from one checkpoint folder, checked before any of it is applied."""

    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    state: dict[str, Any]  # trainer_state.json, plus "components"
    rng: dict[str, Any] | None


def _numpy_rng_globals() -> list[Any]:
    """What numpy's own RNG state tuple pickles to: the allow-list for RNG files written before 2026-12."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    # numpy 2 pickles it as numpy._core..., numpy 1 as numpy.core...
    return [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
    ]


def load_plain(file: Path, *, map_location: Any = None, old_rng: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors and plain values, never code. A file that holds other objects
    raises :class:`UnsafeCheckpoint` naming them; one that cannot be read, :class:`CorruptCheckpoint`.
    ``old_rng`` also allows the numpy arrays of an RNG state written before 2026-12."""
    try:
        if old_rng:
            with torch.serialization.safe_globals(_numpy_rng_globals()):
                return torch.load(file, map_location=map_location, weights_only=True)
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # noqa: BLE001 - not even a readable archive: damaged
            unsafe = []
        if not unsafe:
            raise CorruptCheckpoint(f"{Path(file).name}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
        raise UnsafeCheckpoint(
            f"{file} holds Python objects ({', '.join(unsafe)}), not only tensors and plain values: gyremedia refuses "
            "to load it, since unpickling them could run any code; if you wrote it yourself and trust it, resume "
            "from an earlier checkpoint, or start a new run (run.output_dir) from its trainable.safetensors "
            "weights"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:  # a read error (OSError) is the disk's, not the file's
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        raise CorruptCheckpoint(f"{Path(file).name}: {type(exc).__name__}: {exc}") from exc


def _load_rng(file: Path) -> dict[str, Any]:
    try:
        return load_plain(file)
    except UnsafeCheckpoint:  # written before 2026-12: numpy's state was its own tuple of arrays
        return load_plain(file, old_rng=True)


def read_checkpoint(accelerator, path: Path) -> LoadedCheckpoint:
    """Read a checkpoint (this rank's RNG included); raise :class:`CorruptCheckpoint` if any part fails and
    :class:`UnsafeCheckpoint` if a file holds more than tensors and plain values."""
    path = Path(path)
    verify(path)
    # torch.load restores no indexed CPU device, which accelerate names its gloo processes' device (cpu:0)
    device = torch.device("cpu") if accelerator.device.type == "cpu" else accelerator.device
    data, text = (path / WEIGHTS).read_bytes(), (path / TRAINER_STATE).read_text(errors="replace")
    try:
        weights, state = load(data), json.loads(text)
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file raises, the checkpoint is unusable
        raise CorruptCheckpoint(f"{type(exc).__name__}: {exc}") from exc
    # outside: a failure here (out of memory) is not the checkpoint's
    weights = {k: v.to(device) for k, v in weights.items()}
    # on the CPU: load_state_dict moves each state to its parameter's device; a sharded run's (whole) state
    # must not land whole on every accelerator
    optimizer = load_plain(path / OPTIMIZER, map_location="cpu")
    scheduler = load_plain(path / SCHEDULER)
    components = path / COMPONENTS
    state["components"] = load_plain(components, map_location=device) if components.is_file() else {}
    rng_file = path / f"rng_rank{accelerator.process_index}.pt"
    rng = _load_rng(rng_file) if rng_file.is_file() else None
    return LoadedCheckpoint(path, weights, optimizer, scheduler, state, rng)


def saved_config(path: Path) -> str | None:
    """The resolved config (yaml) a checkpoint was written with; ``None`` for one written before 2026-12."""
    file = Path(path) / CONFIG
    return file.read_text() if file.is_file() else None


def read_latest_checkpoint(accelerator, run_dir: Path) -> LoadedCheckpoint | None:
    """The newest checkpoint that every rank reads whole; ``None`` when the run has none yet.

    A damaged newer one is moved aside (main rank) with a warning, and the one before is tried; when every
    checkpoint is damaged, :class:`NoUsableCheckpoint` is raised rather than starting again from step 0. A file
    that is not plain values raises :class:`UnsafeCheckpoint` on every rank."""
    damaged: list[str] = []
    for path in reversed(list_checkpoints(run_dir)):
        loaded, error, code = None, cast(Exception | None, None), 0
        try:
            loaded = read_checkpoint(accelerator, path)
        except CorruptCheckpoint as exc:
            error, code = exc, 1
        except Exception as exc:  # noqa: BLE001 - unsafe, or not the checkpoint's fault (a read error, out of memory)
            error, code = exc, 2
        worst = int(largest_on_any_rank(accelerator, code)[0])
        if worst == 0:
            return loaded
        if worst == 2:  # every process stops, the checkpoint left where it is
            raise_together(accelerator, error if code == 2 else None)
        why = error or "unreadable on another process"
        damaged.append(f"{path.name} ({why})")
        if accelerator.is_main_process:
            try:
                set_aside(path, why)
            except OSError as exc:  # it stays, and is skipped again next time
                logger.warning("could not move the damaged checkpoint %s aside: %s", path, exc)
        accelerator.wait_for_everyone()
    if damaged:
        raise NoUsableCheckpoint(
            f"{run_dir}: every checkpoint is damaged ({'; '.join(damaged)}); they were moved to "
            f"{Path(run_dir) / CHECKPOINT_DIR / DAMAGED_DIR}: restore a good copy of one into "
            f"{Path(run_dir) / CHECKPOINT_DIR}, or start a new run (run.output_dir)"
        )
    return None


def apply_checkpoint(
    loaded: LoadedCheckpoint, *, load_optimizer: Callable[[dict[str, Any]], None], scheduler, process_index: int
) -> None:
    """Restore the optimizer (through ``load_optimizer``), the LR schedule and this rank's RNG from a
    checkpoint that was read whole."""
    load_optimizer(loaded.optimizer)
    scheduler.load_state_dict(loaded.scheduler)
    if loaded.rng is not None:
        set_rng_state(loaded.rng)
    else:
        logger.warning(
            "%s has no RNG state for rank %d (saved with %d processes); continuing with fresh RNG",
            loaded.path,
            process_index,
            loaded.state["num_processes"],
        )
