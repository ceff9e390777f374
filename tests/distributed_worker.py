"""Worker for tests/test_distributed.py: trains the tiny config and dumps what each rank saw.

Run with plain ``python`` (one process) or under ``accelerate launch`` (several), ``--resume`` among the
overrides to continue the run in ``run.output_dir``; writes
``OUT/rank{r}.json`` with every step's sample ids, rewards and advantages, and the final weights.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from gyremedia import hookimpl
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.runtime.distributed import global_nanmeans
from gyremedia.trainer import Trainer


class StepRecorder:
    def __init__(self) -> None:
        self.steps = []
        self.forward_rows = 0  # rows through the trained network after the first step

    def count(self, module, args, kwargs):
        self.forward_rows += next(v for v in (*args, *kwargs.values()) if torch.is_tensor(v)).shape[0]

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics):
        if not self.steps:
            state.backbone.trainable_module().register_forward_pre_hook(self.count, with_kwargs=True)
        rollout = state.rollout
        self.steps.append(
            {
                "sample_ids": rollout.sample_ids.tolist(),
                "group_ids": rollout.group_ids.tolist(),
                "rewards": rollout.reward.tolist(),
                "advantages": rollout.advantages.tolist(),
                "reward_metric": metrics["reward"],
                "grad_norm": metrics["grad_norm"],  # read from a DTensor, gathered, when the model is sharded
                # parameters this process holds (its shards when sharded) and those of the whole model
                "local_parameters": sum(
                    p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                    for p in state.backbone.trainable_module().parameters()
                ),
                "parameters": sum(p.numel() for p in state.backbone.trainable_module().parameters()),
            }
        )


def main(config_path: str, out_dir: str, *overrides: str) -> None:
    recorder = StepRecorder()
    pm = PluginManager(extra_plugins=[recorder])
    resume = "--resume" in overrides
    config = resolve_config(load_config(config_path, [o for o in overrides if o != "--resume"]), pm)
    state = Trainer(config, pm, resume=resume).train()
    # the whole weights: a sharded run's are gathered to the main process for its export
    weights = [
        p.detach().flatten() for p in state.backbone.trainable_module().parameters() if not hasattr(p, "to_local")
    ]
    rank = state.accelerator.process_index
    # Metrics whose keys differ between ranks (a reward that failed on one rank logs no components there).
    uneven = {"shared": torch.tensor([float(rank), float("nan")]), f"rank{rank}_only": torch.tensor([rank + 1.0])}
    record = {
        "num_processes": state.accelerator.num_processes,
        "steps": recorder.steps,
        "forward_rows": recorder.forward_rows,
        "weights": torch.cat(weights).tolist() if weights else [],
        "uneven_means": global_nanmeans(state.accelerator, uneven),
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    # leave the process group together, as `gyremedia train` does: a rank exiting inside it can abort
    state.accelerator.wait_for_everyone()
    state.accelerator.end_training()
    # Then exit without the interpreter's teardown: once in a CI run, after all of the above, a rank of the FSDP2
    # test aborted there ("terminate called without an active exception", SIGABRT), as gloo's worker threads can
    # when objects they hold are destroyed during finalisation (pytorch/pytorch#179291). Every result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
