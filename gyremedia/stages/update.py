"""The update stage: one optimizer step per minibatch of a rollout, gradients accumulated over the objective's
micro-steps, the regularizers' terms added to its loss, a non-finite loss stopped (or skipped) before it lands."""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, cast

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import LossOutput, ObjectiveContext, Preparing
from gyremedia.rollout import Rollout
from gyremedia.runtime import checkpoint as ckpt
from gyremedia.runtime.distributed import any_rank, average_gradients, host_floats, means_over_ranks
from gyremedia.sampling import KeptForwards
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


class NonFiniteLoss(RuntimeError):
    """A loss term or the gradient was NaN or inf: the run stopped before that update."""

    exit_code = 1

    def __init__(self, step: int, terms: list[str], last_checkpoint: int | None) -> None:
        saved = (
            f"the last checkpoint ({ckpt.checkpoint_name(last_checkpoint)}) holds finite weights"
            if last_checkpoint is not None
            else "no checkpoint was written yet"
        )
        super().__init__(
            f"step {step}: {', '.join(terms)} not finite; the run stopped before this update, so {saved}: "
            "lower train.learning_rate or train.max_grad_norm, or set train.on_nonfinite=skip to drop such "
            "updates"
        )
        self.step, self.terms = step, terms


def micro_step_loss(
    state: TrainState,
    ctx: ObjectiveContext,
    batch: Rollout,
    micro: Any,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The objective's loss on one micro-step plus each regularizer's weighted terms; the terms to log."""
    out = state.objective.loss(ctx, batch, micro)
    loss, terms = out.loss, dict(out.metrics)
    for selected in state.config.regularizers:
        result = state.regularizers[selected.name](state=state, rollout=batch, outputs=out.outputs)
        if isinstance(result, LossOutput):  # one loss term plus metrics
            loss = loss + selected.weight * result.loss
            terms[f"{selected.name}/loss"] = result.loss.detach()
            terms.update({f"{selected.name}/{k}": v.detach() for k, v in result.metrics.items()})
            continue
        for key, value in result.items():  # named loss terms
            loss = loss + selected.weight * value
            terms[f"{selected.name}/{key}"] = value.detach()
    terms["loss"] = loss.detach()
    return loss, terms


def accumulate(
    state: TrainState, ctx: ObjectiveContext, batch: Rollout, step: int, reduce_here: bool
) -> tuple[dict[str, torch.Tensor | float], int]:
    """Backward over the objective's micro-steps of one minibatch; each term's sum over them, and their number."""
    acc = state.accelerator
    micro_steps = state.objective.micro_steps(batch, step)
    summed: dict[str, torch.Tensor | float] = {}  # each term's sum over the micro-steps, where it was computed
    for k, micro in enumerate(micro_steps):
        last = k == len(micro_steps) - 1
        # sharded gradients are reduce-scattered every micro-step (skipping it would keep whole ones)
        sync = (
            contextlib.nullcontext()
            if (last and not reduce_here) or state.sharded
            else acc.no_sync(state.trained_module)
        )
        with sync:
            loss, terms = micro_step_loss(state, ctx, batch, micro)
            acc.backward(loss / len(micro_steps))
        for key, value in terms.items():  # in float32 on the device (bf16 terms would lose digits)
            summed[key] = summed.get(key, 0.0) + (value.detach().float() if isinstance(value, torch.Tensor) else value)
    return summed, len(micro_steps)


def step_optimizer(
    state: TrainState, summed: dict[str, Any], step: int, reduce_here: bool, sums: dict[str, float], micro_steps: int
) -> bool:
    """Clip, check every term is finite on every rank, and step the optimizer (or stop, or skip: the run's
    ``train.on_nonfinite``); adds the minibatch's terms to ``sums``. Returns whether it stepped."""
    acc, train = state.accelerator, state.config.core.train
    if reduce_here:
        average_gradients(acc, state.params)
    summed["grad_norm"] = acc.clip_grad_norm_(state.params, train.max_grad_norm)
    # The one read of the device per optimizer step (a float() per term and micro-step would make the host
    # wait for the accelerator each time). A sum is not finite when one of its micro-steps' values is not
    # (or when finite values overflow float32 together, beyond 3.4e38: a diverged run all the same).
    values = host_floats(summed)
    not_finite = {key for key, value in values.items() if not math.isfinite(value)}
    grad_norm = values.pop("grad_norm")
    for key, value in values.items():
        sums[key] = sums.get(key, 0.0) + value
    # Every rank takes the same decision (a NaN on one rank reaches the others' gradients anyway).
    if any_rank(acc, bool(not_finite))[0]:
        if train.on_nonfinite == "stop":
            raise NonFiniteLoss(
                step + 1,
                sorted(not_finite) or ["(on another process)"],
                state.last_save[0] if state.last_save else None,
            )
        logger.warning(
            "step %d: %s not finite: update skipped (train.on_nonfinite=skip)",
            step + 1,
            ", ".join(sorted(not_finite)) or "a loss term on another process",
        )
        state.optimizer.zero_grad(set_to_none=True)
        return False
    state.optimizer.step()
    state.lr_scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm * micro_steps
    return True


@hookimpl(trylast=True)
def gyremedia_update(state: TrainState, rollout: Rollout, step: int) -> dict[str, float]:
    """One optimizer step per minibatch; gradients accumulate over the objective's micro-steps."""
    acc, train, objective = state.accelerator, state.config.core.train, state.objective
    state.backbone.trainable_module().train()
    ctx = ObjectiveContext(
        backbone=state.backbone,
        sampler=state.sampler,
        step=step,
        weighting=state.weighting,
        guidance_scale=state.config.core.rollout.guidance_scale,
        accelerator=acc,
        minibatches=train.num_minibatches,
        passes=train.num_iterations,
    )
    size = len(rollout) // train.num_minibatches
    sums: dict[str, float] = {}
    count = skipped = 0
    if state.config.objective.meta.get("prepares"):
        cast(Preparing, objective).prepare(ctx, rollout)
    for n, begin in enumerate([b for _ in range(train.num_iterations) for b in range(0, len(rollout), size)]):
        if n:  # after the first update the forwards kept while sampling are stale
            KeptForwards.discard(rollout)
        batch = rollout.select(slice(begin, begin + size))
        reduce_here = batch.kept_forwards is not None and acc.num_processes > 1  # their backward syncs nothing
        summed, micro_steps = accumulate(state, ctx, batch, step, reduce_here)
        count += micro_steps
        skipped += not step_optimizer(state, summed, step, reduce_here, sums, micro_steps)
    KeptForwards.discard(rollout)  # a single minibatch, or one that did not replay what was kept
    metrics = means_over_ranks(acc, {key: total / count for key, total in sums.items()})
    metrics["lr"] = state.lr_scheduler.get_last_lr()[0]
    if train.on_nonfinite == "skip":
        state.nonfinite_skipped += skipped
        metrics["train/nonfinite_skipped"] = float(state.nonfinite_skipped)
    return metrics
