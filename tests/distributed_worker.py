"""Worker for tests/test_distributed.py: trains the tiny config and dumps what each rank saw.

Run with plain ``python`` (one process) or under ``accelerate launch`` (several); writes
``OUT/rank{r}.json`` with every step's sample ids, rewards and advantages, and the final weights.
"""

import json
import sys
from pathlib import Path

import torch

from gyremedia import hookimpl
from gyremedia.config import load_config, resolve_config
from gyremedia.distributed import global_nanmeans
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


class StepRecorder:
    def __init__(self) -> None:
        self.steps = []

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics):
        rollout = state.rollout
        self.steps.append({
            "sample_ids": rollout.sample_ids.tolist(),
            "group_ids": rollout.group_ids.tolist(),
            "rewards": rollout.reward.tolist(),
            "advantages": rollout.advantages.tolist(),
            "reward_metric": metrics["reward"],
        })


def main(config_path: str, out_dir: str, *overrides: str) -> None:
    recorder = StepRecorder()
    pm = PluginManager(extra_plugins=[recorder])
    config = resolve_config(load_config(config_path, list(overrides)), pm)
    state = Trainer(config, pm).train()
    weights = torch.cat([p.detach().flatten() for p in state.backbone.trainable_module().parameters()])
    rank = state.accelerator.process_index
    # Metrics whose keys differ between ranks (a reward that failed on one rank logs no components there).
    uneven = {"shared": torch.tensor([float(rank), float("nan")]), f"rank{rank}_only": torch.tensor([rank + 1.0])}
    record = {"num_processes": state.accelerator.num_processes, "steps": recorder.steps, "weights": weights.tolist(),
              "uneven_means": global_nanmeans(state.accelerator, uneven)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
