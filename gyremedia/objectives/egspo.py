"""EGSPO: the exact policy gradient of a diffusion LM over its denoising steps, with intermediate advantages.

Decoding is a finite-horizon MDP: state ``s_k`` is the prompt and the partly unmasked completion before step k,
action ``a_k`` the tokens step k commits, and the reward ``R`` comes at the end. The trajectory's log-likelihood
is the sum of its steps' (``log p(tau) = sum_k log pi(a_k | s_k)``, which the backbone replays exactly), so

    grad E[R] = E[ sum_k (R - b(s_k)) grad log pi(a_k | s_k) ]

for any baseline ``b(s_k)`` that depends on the state alone: an exact, unbiased gradient with no sequence
likelihood to estimate (``tests/objectives/test_dllm_objectives.py`` enumerates every trajectory of a tiny model
and checks it). EGSPO's two approximations make it cheap:

- **intermediate advantages from one-step denoising**: ``b(s_k) = r(x^_k)``, the reward of the model's own
  one-step prediction from ``s_k`` (every mask filled with its likeliest token, recorded while decoding), so step
  k is credited with how much the rest of the trajectory did beyond what the model already predicted there.
  ``A_bk = (R_b - r(x^_bk)) / (std_g(R) + eps)``, the group's reward std as GRPO's (``advantage.std``; the batch's
  for a group whose rewards are all equal), clipped to ``adv_clip_max``.
- **entropy-guided steps**: a step whose positions the model is sure of moves ``log pi`` little; each sample
  trains its ``steps_per_update`` steps of highest mean entropy (over the positions the step could commit),
  which bounds the dropped terms by the entropy left out. Only those steps' predictions are scored and replayed.

The loss, per sample b: ``sum_{k in S_b} -min(r_bk A_bk, clip(r_bk) A_bk)`` with ``r_bk`` the step's ratio (1 on
the first update), averaged over the batch. Needs a backbone that decodes in steps (``replays_steps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, LossOutput, ObjectiveContext
from gyremedia.objectives.clipped_ratio import clipped, clipped_ratio_loss
from gyremedia.objectives.token_grpo import aggregate_tokens, bounded_log_ratio, old_log_probs
from gyremedia.options import OptionError, option
from gyremedia.rollout import Rollout
from gyremedia.scoring import Scorer
from gyremedia.stages import advantages as advantage_stage
from gyremedia.state import TrainState


@dataclass
class EGSPOOptions:
    steps_per_update: int = option(0, ge=0, help="steps trained per sample, the highest-entropy ones (0: every step)")
    adv_clip_max: float = option(5.0, gt=0, help="step advantages are clipped to [-adv_clip_max, adv_clip_max]")
    epsilon: float = option(0.2, gt=0, help="clip eps_low of each step's ratio")
    epsilon_high: float | None = option(None, gt=0, help="clip eps_high (default: epsilon)")
    kl_beta: float = option(0.0, ge=0, help="weight of the k3 KL to the reference (selects the token_kl regularizer)")

    def validate(self) -> None:
        if self.epsilon >= 1:
            raise OptionError("epsilon", "must be below 1: the ratio's lower bound is 1 - epsilon")


def entropy_guided_steps(entropy: torch.Tensor, taken: torch.Tensor, count: int) -> torch.Tensor:
    """``[B, K]`` booleans: each sample's ``count`` steps of highest ``entropy`` among those it ``taken`` (that
    committed a token); every taken step when ``count`` is 0."""
    if count == 0:
        return taken.clone()
    ranked = entropy.masked_fill(~taken, -torch.inf).argsort(-1, descending=True).argsort(-1)
    return (ranked < count) & taken


def egspo_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample losses ``[B]``: the clipped step surrogates summed over the selected steps (``[B, K]`` each;
    module docstring), and the ratios."""
    per_step, ratio = clipped_ratio_loss(log_ratio, advantages, eps_low, eps_high)
    return (per_step * selected).sum(-1), ratio


class EGSPOObjective:
    """Per-step clipped policy gradient with one-step-denoising advantages on the highest-entropy steps."""

    requires_log_prob = True
    transitions = "tokens"
    kl_regularizer = "token_kl"
    prepares = True

    def __init__(self, options: EGSPOOptions, context: BuildContext) -> None:
        self.options = options
        self.eps_low = options.epsilon
        self.eps_high = options.epsilon_high if options.epsilon_high is not None else options.epsilon

    def prepare(self, ctx: ObjectiveContext, rollout: Rollout) -> None:
        """The old policy's step log-probs when several updates share the rollout."""
        if "step_advantages" not in rollout.extras:
            raise ValueError("egspo needs the step advantages its plugin computes (gyremedia_setup registers it)")
        if ctx.minibatches * ctx.passes > 1:
            steps = _columns(rollout)
            rollout.extras["old_step_log_probs"] = old_log_probs(
                ctx, rollout, lambda part: _scatter(ctx.backbone.step_log_probs(part, steps), steps, part)
            )

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        return [0]

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        selected, advantages = rollout.extras["egspo_steps"], rollout.extras["step_advantages"]
        steps = _columns(rollout)
        log_probs = _scatter(ctx.backbone.step_log_probs(rollout, steps), steps, rollout)
        old = rollout.extras.get("old_step_log_probs", log_probs.detach())
        log_ratio = bounded_log_ratio(log_probs, old)
        per_sample, ratio = egspo_loss(log_ratio, advantages.to(log_probs), selected, self.eps_low, self.eps_high)
        count = selected.sum().clamp(min=1)
        metrics = {
            "policy_loss": per_sample.mean().detach(),
            "ratio": (ratio.detach() * selected).sum() / count,
            "clip_fraction": (clipped(ratio, self.eps_low, self.eps_high) & selected).sum() / count,
            "approx_kl": (0.5 * log_ratio.detach() ** 2 * selected).sum() / count,
            "trained_steps": selected.sum(-1).float().mean(),
        }
        outputs: dict[str, Any] = {}
        if self.options.kl_beta:  # the token_kl regularizer reads the backbone's token log-probs
            mask = rollout.mask.bool()
            outputs = {
                "log_probs": ctx.backbone.token_log_probs(rollout),
                "mask": mask,
                "aggregate": partial(aggregate_tokens, mask=mask, loss_type="grpo", max_length=mask.shape[1]),
            }
        return LossOutput(loss=per_sample.mean(), metrics=metrics, outputs=outputs)


def _columns(rollout: Rollout) -> list[int]:
    """The steps any sample of ``rollout`` trains (each is one forward)."""
    return rollout.extras["egspo_steps"].any(0).nonzero().flatten().tolist()


def _scatter(columns: torch.Tensor, steps: list[int], rollout: Rollout) -> torch.Tensor:
    """``[B, K]`` step log-probs from the replayed ``steps``' columns (0 at the others)."""
    full = torch.zeros(rollout.extras["egspo_steps"].shape, device=columns.device, dtype=columns.dtype)
    return full.index_copy(1, torch.tensor(steps, device=columns.device, dtype=torch.long), columns)


class StepAdvantages:
    """Takes the advantage stage over: the step advantages ``A_bk`` of the entropy-selected steps, their
    one-step predictions scored by the run's rewards (module docstring). ``rollout.advantages`` stays GRPO's."""

    def __init__(self, steps_per_update: int, clip: float) -> None:
        self.steps_per_update, self.clip = steps_per_update, clip
        self.scorer: Scorer | None = None

    @hookimpl(tryfirst=True)
    def gyremedia_compute_advantages(self, state: TrainState, rollout: Rollout, step: int) -> dict[str, float] | None:
        if not isinstance(state.objective, EGSPOObjective):  # registered by an earlier run in this process
            return None
        metrics = advantage_stage.gyremedia_compute_advantages(state=state, rollout=rollout, step=step)
        order = rollout.conditions["order"]
        entropy = rollout.extras["step_entropy"]
        taken = torch.stack([(order == k).any(-1) for k in range(entropy.shape[1])], dim=1)
        selected = entropy_guided_steps(entropy, taken, self.steps_per_update)
        rows, steps = selected.nonzero(as_tuple=True)
        media = state.backbone.step_media(rollout, rows, steps)
        prompts = [rollout.prompts[int(r)] for r in rows]
        # the rewards that count (a weight-0 reward is only logged, and one that reads the whole decoding, such as
        # tokens_per_forward, has nothing to read in a one-step prediction)
        counted = [s for s in state.config.rewards if s.weight]
        self.scorer = self.scorer or Scorer(counted, state.rewards)
        scored = self.scorer.collect(self.scorer.submit(media, prompts), prompts, step)
        weights = {s.name: s.weight for s in counted}
        values = sum(weights[name] * c["score"].double() for name, c in scored.components.items())
        matrix, reward_weights = advantage_stage.weighted_rewards(state.config, rollout)
        _, totals, groups = advantage_stage.group_relative(state, rollout, matrix, reward_weights)
        scale = self._scales(state, totals.double(), groups, rollout.group_ids)
        own = (matrix.double() * reward_weights.double().to(matrix.device)).sum(-1)
        step_advantages = torch.zeros(selected.shape, dtype=torch.float32, device=rollout.states.device)
        advantage = (own[rows].cpu() - values.cpu()) / scale[rows.cpu()]
        step_advantages[rows, steps] = advantage.clamp(-self.clip, self.clip).float().to(step_advantages.device)
        rollout.extras.update(egspo_steps=selected, step_advantages=step_advantages)
        metrics["egspo/step_value"] = float(values.mean())
        return metrics

    @staticmethod
    def _scales(state: TrainState, totals: torch.Tensor, groups: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Each local sample's advantage scale: its group's reward std (every rank's), the batch's, or 1. A group
        whose rewards are all equal has no GRPO advantage, but its steps still have intermediate ones (a prediction
        the trajectory fell short of): they take the batch's std, not ``eps`` (which made them 1e4)."""
        adv = state.config.core.advantage
        if adv.std == "none":
            return torch.ones(len(local), dtype=torch.float64)
        batch = float(totals.std(unbiased=False)) + adv.eps
        if adv.std == "global":
            return torch.full((len(local),), batch, dtype=torch.float64)
        stds = {int(g): float(totals[groups == g].std(unbiased=False)) for g in groups.unique()}
        return torch.tensor([stds[int(g)] + adv.eps if stds[int(g)] > 0 else batch for g in local.cpu()])


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    backbone, objective = selected.get("backbone"), selected.get("objective")
    if objective is None or objective.name != "egspo" or backbone is None or backbone.meta.get("replays_steps"):
        return []
    return [
        f"objective 'egspo' trains a token policy's decoding steps, but backbone {backbone.name!r} samples no steps "
        "it can replay: use masked_diffusion_lm, or token_grpo / stable_drl"
    ]


@hookimpl
def gyremedia_setup(state: TrainState, context: Any) -> None:
    if isinstance(state.objective, EGSPOObjective):
        o = state.objective.options
        state.plugins.register_for_run(StepAdvantages(o.steps_per_update, o.adv_clip_max), name="egspo:run")


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "egspo",
        EGSPOObjective,
        options=EGSPOOptions,
        description="EGSPO (diffusion LLMs): exact per-step policy gradient, one-step-denoising advantages",
    )
