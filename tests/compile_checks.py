"""Train a config eagerly and with ``train.compile``, for the tests that hold the compiled update to the eager one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch._dynamo.utils import counters

from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


@dataclass
class EagerAndCompiled:
    eager: torch.Tensor  # the eager run's update of every parameter, flattened
    compiled: torch.Tensor  # the compiled run's
    same_names: bool  # the checkpoints' parameter names agree
    compiled_modules: list[list[bool]]  # per run: whether its network and its reference copy (if any) are compiled
    graphs_ran: bool  # compiled graphs ran (dynamo did not fall back to eager)
    last_metrics: list[dict[str, float]]  # per run: what its last step reported

    def relative_difference(self) -> float:
        return float((self.compiled - self.eager).norm() / self.eager.norm())


def train_eager_and_compiled(make: Callable[..., object], out: Path, steps: int, *overrides: str) -> EagerAndCompiled:
    """``steps`` training steps of ``make(*overrides)``, eager then compiled, from the same initial weights."""
    graphs = counters["stats"]["unique_graphs"]
    updates, names, modules, last_metrics = [], [], [], []
    for on in (False, True):
        trainer = Trainer(
            make(f"run.output_dir={out / f'compile-{on}'}", f"train.steps={steps}", f"train.compile={on}", *overrides),
            PluginManager(),
        )
        state = trainer.setup()
        network = state.backbone.trainable_module()
        before = [p.detach().clone() for p in network.parameters()]
        for step in range(steps):
            metrics = trainer.train_step(step)
        last_metrics.append(metrics)
        reference = state.backbone._reference_transformer
        modules.append(
            [getattr(m, "_compiled_call_impl", None) is not None for m in (network, reference) if m is not None]
        )
        names.append(sorted(state.backbone.trainable_state_dict()))
        updates.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(network.parameters(), before)]))
    return EagerAndCompiled(
        eager=updates[0],
        compiled=updates[1],
        same_names=names[0] == names[1],
        compiled_modules=modules,
        graphs_ran=counters["stats"]["unique_graphs"] > graphs,
        last_metrics=last_metrics,
    )
