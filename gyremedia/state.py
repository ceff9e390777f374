"""``TrainState``: what every hook may look at during a run, typed with the component contracts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from gyremedia.config import ResolvedConfig
    from gyremedia.interfaces import Backbone, Logger, Objective, Regularizer, Reward, Sampler, TimestepWeighting
    from gyremedia.plugins import PluginManager
    from gyremedia.rollout import Rollout


@dataclass
class TrainState:
    """The run's config, its components once built, and where the loop stands."""

    config: ResolvedConfig
    accelerator: Accelerator
    run_dir: Path
    plugins: PluginManager
    step: int = 0  # optimizer steps completed (one rollout each)
    backbone: Backbone | None = None
    sampler: Sampler | None = None
    objective: Objective | None = None
    rewards: dict[str, Reward] = field(default_factory=dict)
    regularizers: dict[str, Regularizer] = field(default_factory=dict)
    weighting: TimestepWeighting | None = None  # timestep weighting of an ELBO-family objective, if it uses one
    loggers: list[Logger] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None  # a torch LR scheduler, stepped once per optimizer step
    rollout: Rollout | None = None  # the step's rollout, scored and with advantages, for hooks
    last_metrics: dict[str, float] = field(default_factory=dict)
