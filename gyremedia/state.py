"""``TrainState``: what every hook may look at during a run, typed with the component contracts."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from gyremedia.config import ResolvedConfig
    from gyremedia.data import Prompt, PromptSource
    from gyremedia.interfaces import Backbone, Logger, Objective, Regularizer, Reward, Sampler, TimestepWeighting
    from gyremedia.registry import PluginHost
    from gyremedia.rollout import Rollout
    from gyremedia.scoring import Scorer


#: The value of a field that ``Trainer.setup`` fills before any stage or feature hook runs (typed as what it holds).
BUILT_IN_SETUP: Any = cast(Any, None)


@dataclass
class TrainState:
    """The run's config, its components once built, and where the loop stands."""

    config: ResolvedConfig
    accelerator: Accelerator
    run_dir: Path
    plugins: PluginHost
    step: int = 0  # optimizer steps completed (one rollout each)
    backbone: Backbone = BUILT_IN_SETUP
    sampler: Sampler | None = None
    eval_sampler: Sampler | None = None  # eval.sampler, else the run's sampler
    objective: Objective = BUILT_IN_SETUP
    rewards: dict[str, Reward] = field(default_factory=dict)
    regularizers: dict[str, Regularizer] = field(default_factory=dict)
    weighting: TimestepWeighting | None = None  # timestep weighting of an ELBO-family objective, if it uses one
    loggers: list[Logger] = field(default_factory=list)
    optimizer: torch.optim.Optimizer = BUILT_IN_SETUP
    lr_scheduler: Any = None  # a torch LR scheduler, stepped once per optimizer step
    rollout: Rollout | None = None  # the step's rollout, scored and with advantages, for hooks
    last_metrics: dict[str, float] = field(default_factory=dict)
    # -- what the stages share, set up by the trainer
    sharded: bool = False  # the trained model is sharded over the processes (FSDP2)
    reference_needed: bool = False  # a feature needs the frozen reference policy (set in gyremedia_setup)
    prompts: PromptSource = BUILT_IN_SETUP  # the training prompts
    scorer: Scorer = BUILT_IN_SETUP  # the run's rewards with their failure policies
    trained_module: Any = None  # the trained module as accelerate prepared it (or sharded it)
    params: list[torch.nn.Parameter] = field(default_factory=list)  # its trainable parameters
    # objects besides the components whose state_dict() a checkpoint stores under these names (a feature's state)
    stateful: dict[str, Any] = field(default_factory=dict)
    group_prompts: dict[int, list[Prompt]] = field(default_factory=dict)  # each step's group prompts, drawn once
    eval_scores: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # per sample, step 0 and the last
    last_save: tuple[int, float] | None = None  # (step, monotonic time) of the last checkpoint
    nonfinite_skipped: int = 0  # updates dropped by train.on_nonfinite=skip
    dropped: dict[str, collections.deque] = field(default_factory=dict)  # each dropping reward's recent counts
