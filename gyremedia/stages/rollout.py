"""The rollout stage: a step's request (its prompts, ids and chunks), the features' edits of it, and the sampling."""

from __future__ import annotations

import contextlib

import torch

from gyremedia import hookimpl
from gyremedia.data import Prompt
from gyremedia.interfaces import RolloutRequest
from gyremedia.rollout import Rollout
from gyremedia.state import TrainState


def group_prompts(state: TrainState, step: int) -> list[Prompt]:
    """The prompt of every group of step ``step`` (the same draw on every rank), drawn once: the rollout,
    the next step's prompt prefetch and the per-prompt reward history all read it."""
    if step not in state.group_prompts:
        r = state.config.core.rollout
        kept = {s: p for s, p in state.group_prompts.items() if s >= step - 1}
        state.group_prompts.clear()
        state.group_prompts.update(kept)
        state.group_prompts[step] = state.prompts.groups_for_step(
            state.config.core.run.seed, step, r.batch_size // r.group_size
        )
    return state.group_prompts[step]


def rollout_request(state: TrainState, step: int) -> RolloutRequest:
    """This rank's share of step ``step``: its prompts (the same draw on every rank), ids and chunks."""
    core, acc = state.config.core, state.accelerator
    per_rank = core.rollout.batch_size // acc.num_processes
    start = acc.process_index * per_rank
    prompts = group_prompts(state, step)
    sample_ids = torch.arange(start, start + per_rank)
    group_ids = sample_ids // core.rollout.group_size
    return RolloutRequest(
        step=step,
        seed=core.run.seed,
        prompts=[prompts[g] for g in group_ids.tolist()],
        sample_ids=sample_ids,
        group_ids=group_ids,
        chunks=core.train.num_minibatches,
        settings=core.rollout,
    )


def collect(state: TrainState, step: int) -> Rollout:
    """Step ``step``'s rollout: the request, edited by the features (``gyremedia_prepare_request``), then sampled
    by the rollout stage (``gyremedia_collect_rollout``)."""
    state.backbone.trainable_module().eval()
    request = rollout_request(state, step)
    state.plugins.hook.gyremedia_prepare_request(state=state, request=request)
    # forwards kept for training do not synchronise gradients: their minibatch averages them itself
    with state.accelerator.no_sync(state.trained_module) if request.keep_forwards else contextlib.nullcontext():
        rollout = state.plugins.hook.gyremedia_collect_rollout(state=state, request=request)
    rollout.preference = request.preference  # what the advantages weigh the rewards by
    rollout.metrics.update(request.metrics)
    return rollout


@hookimpl(trylast=True)
def gyremedia_collect_rollout(state: TrainState, request: RolloutRequest) -> Rollout:
    """The policy collects its own rollout: denoising trajectories with the run's sampler, or tokens."""
    return state.backbone.collect_rollout(request, state.sampler)
