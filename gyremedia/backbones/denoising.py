"""The policy stages of every denoising backbone: rollouts (flat or tree), media, evaluation samples, drift.

A denoising backbone implements the denoising contract (:class:`gyremedia.interfaces.DenoisingBackbone`:
``encode``, ``sample_noise``, ``predict``, ``decode`` and a ``scheduler``); inheriting
:class:`DenoisingPolicy` turns it into the policy the trainer drives (:class:`gyremedia.interfaces.Policy`).
A transition is one sampler step of the state; the sampler is the run's ``sampler`` section.

Two noise conventions meet here. ``predict`` and ``sigmas`` are the backbone's own (what its samplers step
on: a flow's velocity, or a variance-preserving model's noise at ``sigma = sqrt(1 - alpha_bar)``). The
forward-process objectives and the reference drift work on the flow path ``x_t = (1 - t) x0 + t eps``
(:func:`gyremedia.sampling.renoise`) with the velocity ``v = eps - x0`` there, through :meth:`flow_velocity`:
the policy owns that conversion, and for a flow backbone it is the identity.
"""

from __future__ import annotations

import copy
import math

import torch

from gyremedia.interfaces import Generated, RolloutRequest, Sampler
from gyremedia.rollout import Media, Rollout
from gyremedia.runtime.streams import Stream, sample_generators
from gyremedia.sampling import KeptForwards, noise_like, renoise, sample_trajectories
from gyremedia.tree import sample_trees


class DenoisingPolicy:
    """Rollouts, media, evaluation samples and reference drift for a backbone that denoises states."""

    transitions = "denoising"
    # every process samples the same number of chunks and steps, so sharded forwards stay in lockstep
    shardable = True
    device: torch.device

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's ``num_steps + 1`` noise levels, from 1 down to 0."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps, device=self.device)
        return scheduler.sigmas.float()

    def flow_velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The velocity ``v = eps - x0`` at flow-path states ``x = (1 - t) x0 + t eps`` (``t`` a scalar or
        ``[B]``), what the forward-process objectives train. A flow backbone predicts exactly that (this
        default); a backbone on another forward process overrides it with its exact conversion."""
        return self.predict(x, t, conditions, guidance_scale, reference=reference)

    def conditions(self, prompts: list[str], preference: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The backbone's conditions for ``prompts``, plus Pareto preference weights (``[B, R]``, or one
        ``[R]`` vector for every sample) when given."""
        conditions = self.encode(prompts)
        if preference is not None:
            device = next(iter(conditions.values())).device
            conditions["preference"] = preference.to(device).expand(len(prompts), -1)
        return conditions

    @torch.no_grad()
    def collect_rollout(self, request: RolloutRequest, sampler: Sampler) -> Rollout:
        """Sample the request's trajectories (trees with ``branch_steps``) in the chunks training will replay,
        every sample's noise drawn from ``(seed, step, stream, its id)``."""
        r = request.settings
        per_rank = len(request.prompts)
        chunk = per_rank // request.chunks
        noise_ids = (
            request.noise_ids
            if request.noise_ids is not None
            else (request.group_ids if r.same_noise_in_group else request.sample_ids)
        )
        parts, ancestors, forward_rows, sigmas, kept = [], [], 0, None, None
        for begin in range(0, per_rank, chunk):
            span = slice(begin, begin + chunk)
            preference = request.preference[span] if request.preference is not None else None
            conditions = self.conditions(request.prompts[span], preference)
            if r.branch_steps:
                if request.recorders:
                    raise ValueError(
                        "transition recorders (spatial credit, GRPO-Guard) record flat rollouts, not trees"
                    )
                # groups are whole in a chunk: its first member's conditions are its tree's
                tree = sample_trees(
                    self,
                    sampler,
                    {k: v[:: r.group_size] for k, v in conditions.items()},
                    group_ids=request.group_ids[span][:: r.group_size].tolist(),
                    seed=request.seed,
                    step=request.step,
                    branch_steps=list(r.branch_steps),
                    width=r.branch_width,
                    num_steps=r.num_steps,
                    guidance_scale=r.guidance_scale,
                    roots=r.branch_roots,
                )
                states, log_probs, sigmas = tree.states, tree.log_probs, tree.sigmas
                # node ids unique across chunks: offset by the nodes of earlier chunks at each level
                ancestors.append(tree.ancestors + (ancestors[-1].max(dim=0).values + 1 if ancestors else 0))
                forward_rows += tree.forward_rows
            else:
                if begin == 0 and request.keep_forwards:  # the first minibatch trains before any weight changes
                    kept = KeptForwards(request.sample_ids[span], frozenset(request.keep_forwards))
                states, log_probs, sigmas = sample_trajectories(
                    self,
                    sampler,
                    conditions,
                    initial_generators=sample_generators(
                        request.seed, request.step, Stream(request.noise_stream), noise_ids[span].tolist()
                    ),
                    step_generators=sample_generators(
                        request.seed, request.step, Stream.STEP_NOISE, request.sample_ids[span].tolist()
                    ),
                    num_steps=r.num_steps,
                    guidance_scale=r.guidance_scale,
                    keep=kept if begin == 0 else None,
                    recorders=request.recorders,
                )
            parts.append((conditions, states, log_probs))
        # a tree's structure, and the share of a flat rollout's model evaluations it needed
        metrics = {"rollout/forward_fraction": forward_rows / (per_rank * r.num_steps)} if ancestors else {}
        return Rollout(
            prompts=list(request.prompts),
            sample_ids=request.sample_ids,
            group_ids=request.group_ids,
            conditions={k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]},
            states=torch.cat([p[1] for p in parts]),
            log_probs=torch.cat([p[2] for p in parts]) if parts[0][2] is not None else None,
            sigmas=sigmas,
            metrics=metrics,
            tree_ancestors=torch.cat(ancestors) if ancestors else None,
            kept_forwards=kept,
            extras={recorder.key: recorder.result() for recorder in request.recorders},
        )

    def media(self, rollout: Rollout) -> Media:
        """The rollout's final states, decoded."""
        return self.decode(rollout.final)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        *,
        seed: int,
        sampler: Sampler,
        num_steps: int,
        guidance_scale: float,
        batch_size: int = 64,
        preference: torch.Tensor | None = None,
    ) -> Generated:
        """One sample per prompt; sample ``i`` always uses the noise of ``(seed, i)``. Extras: the final states."""
        parts = []
        for begin in range(0, len(prompts), batch_size):
            chunk = prompts[begin : begin + batch_size]
            ids = list(range(begin, begin + len(chunk)))
            states, _, _ = sample_trajectories(
                self,
                sampler,
                self.conditions(chunk, preference),
                initial_generators=sample_generators(seed, 0, Stream.INITIAL_NOISE, ids),
                step_generators=sample_generators(seed, 0, Stream.STEP_NOISE, ids),
                num_steps=num_steps,
                guidance_scale=guidance_scale,
            )
            parts.append((self.decode(states[:, -1]), states[:, -1]))
        media = [p[0] for p in parts]
        return Generated(
            Media(media[0].kind, torch.cat([m.data for m in media]), media[0].meta),
            {"final_states": torch.cat([p[1] for p in parts])},
        )

    @torch.no_grad()
    def reference_drift(
        self,
        prompts: list[str],
        generated: Generated,
        *,
        levels: int,
        guidance_scale: float,
        preference: torch.Tensor | None = None,
        batch_size: int = 64,
    ) -> float:
        """``mean ||v - v_ref||^2 / mean ||v_ref||^2`` on the generated samples' clean states re-noised at
        ``levels`` evenly spaced noise levels (fixed noise, so evaluations compare)."""
        finals = generated.extras.get("final_states")
        if finals is None:
            return math.nan
        gap = norm = 0.0
        for begin in range(0, len(finals), batch_size):
            x0 = finals[begin : begin + batch_size]
            conditions = self.conditions(prompts[begin : begin + len(x0)], preference)
            noise = noise_like(x0, sample_generators(0, 0, Stream.MONITOR, list(range(begin, begin + len(x0)))))
            for t in torch.linspace(0, 1, levels + 2)[1:-1].tolist():
                xt = renoise(x0, noise, t)
                level = torch.tensor(t, device=x0.device)
                v = self.flow_velocity(xt, level, conditions, guidance_scale).float()
                v_ref = self.flow_velocity(xt, level, conditions, guidance_scale, reference=True).float()
                gap += float((v - v_ref).pow(2).sum())
                norm += float(v_ref.pow(2).sum())
        return gap / max(norm, 1e-12)
