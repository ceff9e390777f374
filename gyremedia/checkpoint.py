"""Atomic checkpoints: a run killed at any moment resumes from its last complete checkpoint.

A checkpoint is written into a hidden temporary folder and renamed into place only once every
rank has written its part, so ``checkpoints/step-NNNNNN`` either exists whole or not at all.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger("gyremedia")

CHECKPOINT_DIR = "checkpoints"
WEIGHTS = "trainable.safetensors"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"
COMPONENTS = "components.pt"  # tensors of stateful components (an objective's old policy, ...)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / TRAINER_STATE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


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


def save_checkpoint(accelerator, run_dir: Path, step: int, *, weights: dict[str, torch.Tensor], optimizer,
                    scheduler, plugin_state: dict[str, Any], keep_last: int,
                    component_state: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step`` (every rank calls this) and prune old ones on the main rank."""
    root = Path(run_dir) / CHECKPOINT_DIR
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(scheduler.state_dict(), tmp / SCHEDULER)
        if component_state:
            torch.save(component_state, tmp / COMPONENTS)
        state = {"step": step, "num_processes": accelerator.num_processes, "plugins": plugin_state}
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path, *, optimizer, scheduler) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Restore optimizer, scheduler and this rank's RNG; return the weights and the trainer state.

    The trainer state holds ``"components"``: what stateful components saved (empty if none).
    """
    path = Path(path)
    weights = load_file(str(path / WEIGHTS), device=str(accelerator.device))
    optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location=accelerator.device, weights_only=False))
    scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=False))
    state = json.loads((path / TRAINER_STATE).read_text())
    components = path / COMPONENTS
    state["components"] = torch.load(components, map_location=accelerator.device) if components.is_file() else {}
    rng_file = path / f"rng_rank{accelerator.process_index}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s has no RNG state for rank %d (saved with %d processes); continuing with fresh RNG",
                       path, accelerator.process_index, state["num_processes"])
    return weights, state
