"""Sol-RL's two-stage rollouts: which candidates of a cheap pool are sampled again at full quality.

Per prompt, ``rollout.candidates`` initial noises are sampled cheaply (``rollout.candidate_steps`` steps of
the eval sampler) and scored by the run's rewards. A group's training samples are the candidates that teach
the most: the best and the worst of the pool (the contrastive subset), so the group's reward spread, and its
advantages' signal, is as large as the pool allows. Only those noises are then sampled at full quality with
the run's sampler, and only those are trained on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.config import ConfigError
from gyremedia.interfaces import RolloutRequest
from gyremedia.runtime.distributed import means_over_ranks, raise_together
from gyremedia.runtime.streams import Stream
from gyremedia.stages.advantages import weighted_rewards
from gyremedia.state import TrainState


def contrastive_subset(rewards: torch.Tensor, keep: int) -> torch.Tensor:
    """Per row of ``rewards [G, P]``, the indices of the ``ceil(keep / 2)`` highest and ``floor(keep / 2)``
    lowest rewards (``[G, keep]``, best first). A NaN reward (a failed score) ranks lowest; ties keep pool order."""
    if not 0 < keep <= rewards.shape[1]:
        raise ValueError(f"keep={keep} of {rewards.shape[1]} candidates per group")
    order = rewards.nan_to_num(nan=-torch.inf).argsort(dim=1, descending=True, stable=True)
    best, worst = (keep + 1) // 2, keep // 2
    return torch.cat([order[:, :best], order[:, order.shape[1] - worst :]], dim=1)


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    r, errors = core.rollout, []
    if not r.candidates:
        return []
    backbone = selected.get("backbone")
    if r.candidates % r.group_size or r.candidates == r.group_size:
        errors.append(
            f"rollout.candidates={r.candidates}: draw a larger multiple of rollout.group_size="
            f"{r.group_size} (e.g. {4 * r.group_size}), or 0 for one-stage rollouts"
        )
    if r.branch_steps:
        errors.append(
            "rollout.candidates selects initial noises of flat rollouts: set rollout.branch_steps=[] "
            "or rollout.candidates=0"
        )
    if core.pareto.enabled:
        errors.append(
            "rollout.candidates ranks candidates by the rewards' fixed weights: set pareto.enabled=false "
            "or rollout.candidates=0"
        )
    if backbone is not None and backbone.meta.get("transitions") != "denoising":
        errors.append(
            f"rollout.candidates selects initial noises, which backbone {backbone.name!r} does not "
            f"denoise from: set rollout.candidates=0"
        )
    return errors


@hookimpl
def gyremedia_configure(config: Any, accelerator: Any) -> None:
    """Each group's candidates are ranked on one process: a rank must hold whole groups."""
    r = config.core.rollout
    per_rank = r.batch_size // accelerator.num_processes
    if r.candidates and per_rank % r.group_size:
        raise ConfigError(
            f"candidate selection ranks each group's candidates on one process: make rollout.batch_size / processes "
            f"= {per_rank} a multiple of rollout.group_size={r.group_size}"
        )


@hookimpl
def gyremedia_setup(state: TrainState, context: Any) -> None:
    if state.config.core.rollout.candidates:
        state.plugins.register_for_run(CandidatePools(), name="candidates:run")


def candidate_pool(request: RolloutRequest, num_steps: int) -> RolloutRequest:
    """The request of ``rollout.candidates`` candidates per group of ``request``, each from its own initial
    noise (key ``group * candidates + index`` in the candidate stream), sampled ``num_steps`` steps."""
    r = request.settings
    per_group = r.candidates
    groups = request.group_ids[:: r.group_size]
    keys = (groups[:, None] * per_group + torch.arange(per_group)).flatten()  # unique per group and candidate
    return RolloutRequest(
        step=request.step,
        seed=request.seed,
        prompts=[p for p in request.prompts[:: r.group_size] for _ in range(per_group)],
        sample_ids=keys,
        group_ids=groups.repeat_interleave(per_group),
        chunks=request.chunks * per_group // r.group_size,
        settings=dataclasses.replace(r, num_steps=num_steps, branch_steps=[]),
        noise_ids=keys,
        noise_stream=Stream.CANDIDATES,
    )


class CandidatePools:
    """Sol-RL's first stage, run on each step's request before it is sampled."""

    @hookimpl(trylast=True)
    def gyremedia_prepare_request(self, state: TrainState, request: RolloutRequest) -> None:
        """Draw ``rollout.candidates`` initial noises per group, sample each with ``rollout.candidate_steps`` steps
        of the eval sampler, score them, and point ``request`` at the noises of each group's best and worst
        (:func:`contrastive_subset`); ``rollout/candidate_reward`` is the pool's mean total reward."""
        r = state.config.core.rollout
        pool = candidate_pool(request, r.candidate_steps)
        candidates = state.backbone.collect_rollout(pool, state.eval_sampler)
        scored = error = None
        try:
            scored = state.scorer.collect(
                state.scorer.submit(state.backbone.media(candidates), pool.prompts), pool.prompts, request.step
            )
        except Exception as exc:  # noqa: BLE001 - re-raised on every process
            error = exc
        raise_together(state.accelerator, error)
        candidates.rewards = {name: scores["score"] for name, scores in scored.components.items()}
        matrix, weights = weighted_rewards(state.config, candidates)
        totals = matrix.double() @ weights.double()
        groups = len(pool.prompts) // r.candidates
        chosen = contrastive_subset(totals.reshape(groups, r.candidates), r.group_size)
        request.noise_ids = pool.noise_ids.reshape(groups, r.candidates).gather(1, chosen).flatten()
        request.noise_stream = Stream.CANDIDATES
        reward = means_over_ranks(state.accelerator, {"reward": float(totals.nanmean())})["reward"]
        request.metrics["rollout/candidate_reward"] = reward
