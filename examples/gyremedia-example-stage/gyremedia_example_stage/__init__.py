"""An example third-party gyremedia stage plugin: skip the update of a step whose rewards have no spread.

When every sample of a step (over all processes) got the same reward there is nothing to learn from it: the
group advantages are all zero. The default update stage would still run the model forward and backward and step
AdamW, whose momentum and weight decay move the weights anyway. This plugin takes the update stage over for such
steps (``gyremedia_update`` with ``tryfirst=True`` returns its metrics, so the default does not run) and lets the
default run on every other step (it returns ``None``). Each step's metrics say which happened:
``example_stage/skipped`` is 1.0 or 0.0.

Install it (``pip install ./examples/gyremedia-example-stage``) and turn it on for a run:

    GYREMEDIA_EXAMPLE_STAGE=1 gyremedia train run.yaml

Installing it changes no run: the module only implements ``gyremedia_setup``, which registers the per-run object
that takes the stage over when the variable is set. (A first-party feature reads a key of the core config
instead, declared with ``option(..., owner=...)``; a separate package cannot add keys there.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from gyremedia import hookimpl

logger = logging.getLogger("gyremedia")

#: The environment variable that turns the stage on (``1``, ``true``, ``yes`` or ``on``).
ENABLE_ENV = "GYREMEDIA_EXAMPLE_STAGE"
#: The metric each step reports: 1.0 when its update was skipped, else 0.0.
SKIPPED = "example_stage/skipped"


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


@hookimpl
def gyremedia_setup(state: Any, context: Any) -> None:
    if not enabled():
        return
    if context.is_main_process:
        logger.info("%s: steps whose rewards have no spread skip their update (metric %s)", ENABLE_ENV, SKIPPED)
    state.plugins.register_for_run(SkipFlatUpdates(), name="example_stage:run")


def reward_spread(accelerator: Any, reward: torch.Tensor) -> float:
    """The largest minus the smallest finite reward of the step over every process (one collective: each
    process takes the same decision). ``-inf`` when no reward is finite (every sample dropped)."""
    finite = reward.detach().float()[torch.isfinite(reward.detach())]
    if len(finite):
        local = torch.stack([finite.max(), -finite.min()])
    else:  # neutral for the max over processes
        local = torch.tensor([float("-inf"), float("-inf")])
    local = local.to(accelerator.device)
    if accelerator.num_processes > 1:
        local = accelerator.gather(local[None]).amax(dim=0)
    high, minus_low = local.tolist()
    return high + minus_low


class SkipFlatUpdates:
    """The run's takeover of the update stage, for steps with nothing to learn."""

    @hookimpl(tryfirst=True)
    def gyremedia_update(self, state: Any, rollout: Any, step: int) -> dict[str, float] | None:
        if rollout.reward is None or reward_spread(state.accelerator, rollout.reward) != 0:
            return None  # the next implementation (in the end the default update) runs
        from gyremedia.sampling import KeptForwards

        KeptForwards.discard(rollout)  # forwards kept for this update (train.reuse_rollout_forward): not needed
        if state.accelerator.is_main_process:
            logger.info("step %d: every sample got the same reward, nothing to learn: update skipped", step + 1)
        # The keys the loop and the default update report: ``loss`` (the progress bar reads it) is 0.0, the
        # policy-gradient loss of all-zero advantages; the learning rate did not move (no optimizer step).
        metrics = {"loss": 0.0, "lr": state.lr_scheduler.get_last_lr()[0], SKIPPED: 1.0}
        if state.config.core.train.on_nonfinite == "skip":
            metrics["train/nonfinite_skipped"] = float(state.nonfinite_skipped)
        return metrics

    @hookimpl
    def gyremedia_on_step_end(self, state: Any, metrics: dict[str, float]) -> None:
        metrics.setdefault(SKIPPED, 0.0)  # the default update ran
