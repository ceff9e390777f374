"""GRPO for token policies, with TRL's loss aggregations (GRPO, BNPO, Dr. GRPO, DAPO) and importance
corrections for log-probs recorded by another engine or precision (TIS, MIS, CIS).

For completion token t of sample b, with advantage A_b (the group-normalised reward) and the ratio
r = pi_theta / pi_old of the token under the trained policy and the policy before this rollout's updates:

    l_bt = -min(r A_b, clip(r, 1 - eps_low, 1 + eps_high) A_b) * w_bt      (clipped_ratio_loss)

``pi_old`` is the trainer's own forward before the first update (``old_log_probs``); when one update
uses the rollout, it is the current policy detached, so the first ratio is exactly 1 (TRL's choice).
``w`` corrects the mismatch between the sampler's log-probs ``q`` (recorded at generation) and the
trainer's ``p = pi_old``: none (w = 1), TIS ``min(p / q, C)``, MIS ``p / q`` or 0 above ``C``, CIS
``min(p, sigmoid(logit(q) + delta)) / q`` (the log-odds displacement truncated at ``delta``: a cap on
the weight that tightens as the sampler's confidence ``q`` rises, and never clips small weights up).
The tokens' losses become one number by ``loss_type`` (mask m, batch B, T_max the longest completion):

    grpo:     mean_b [ sum_t m l / sum_t m ]                 (each sequence's token mean, then the batch mean)
    bnpo:     sum_bt m l / sum_bt m                          (this process's token mean)
    dr_grpo:  sum_bt m l / (B T_max)                         (a constant normaliser: no length bias)
    dapo:     sum_bt m l / (N / (processes x minibatches))   (N: the rollout's tokens over every process)

With ``importance_level: sequence`` (GSPO, Zheng et al. 2025) every token of sample b carries its sequence's
ratio ``s_b = exp(mean_t m log(pi_theta / pi_old))``, and the gradient flows through that mean, so with
``loss_type: grpo`` the gradient is ``s_b A_b (1 / |y_b|) sum_t grad log pi_theta(y_bt)`` (GSPO's; its paper clips
at eps 3e-4 / 4e-4). Log ratios are clamped to [-20, 20] before the exponential, as verl does: beyond that the
clip holds the loss flat anyway, and exp stays finite in fp32.

The KL to the reference is the ``token_kl`` regularizer (``kl_beta`` selects it), aggregated the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from gyremedia import hookimpl
from gyremedia.interfaces import BuildContext, LossOutput, ObjectiveContext
from gyremedia.objectives.clipped_ratio import clipped, clipped_ratio_loss
from gyremedia.options import OptionError, option
from gyremedia.rollout import Rollout


@dataclass
class TokenGRPOOptions:
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = option(
        "dapo", help="how token losses are averaged (TRL's default: dapo)"
    )
    epsilon: float = option(0.2, gt=0, help="clip eps_low of the token ratio")
    epsilon_high: float | None = option(
        None, gt=0, help="clip eps_high; DAPO's clip-higher uses 0.28 (default: epsilon)"
    )
    kl_beta: float = option(0.0, ge=0, help="weight of the k3 KL to the reference (selects the token_kl regularizer)")
    overlong_filter: bool = option(False, help="DAPO: completions cut off at max_new_tokens count for nothing")
    importance_correction: Literal["none", "tis", "mis", "cis"] = option(
        "none", help="correct sampler log-probs that differ from the trainer's"
    )
    correction_cap: float = option(2.0, gt=1, help="TIS / MIS: the importance weight cap C")
    cis_threshold: float = option(1.0, gt=0, help="CIS: the largest log-odds displacement delta kept")
    max_completion_length: int | None = option(
        None, ge=1, help="dr_grpo's T_max (default: the backbone's max_new_tokens)"
    )
    importance_level: Literal["token", "sequence"] = option(
        "token",
        help="the ratio per token (GRPO), or one per sequence, the mean of its tokens' log ratios (GSPO: "
        "use with loss_type=grpo, epsilon=3e-4, epsilon_high=4e-4)",
    )

    def validate(self) -> None:
        if self.epsilon >= 1:
            raise OptionError("epsilon", "must be below 1: the ratio's lower bound is 1 - epsilon")


def aggregate_tokens(
    values: torch.Tensor, mask: torch.Tensor, loss_type: str, *, max_length: int, normaliser: float | None = None
) -> torch.Tensor:
    """One loss from per-token values ``[B, T]`` by ``loss_type`` (see the module docstring)."""
    mask = mask.to(values.dtype)
    if loss_type == "grpo":
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (values * mask).sum() / (values.shape[0] * max_length)
    if loss_type == "dapo":
        return (values * mask).sum() / max(normaliser, 1.0)
    raise ValueError(f"loss_type {loss_type!r}: expected grpo, bnpo, dr_grpo or dapo")


#: The largest ``|log p - log q|`` a ratio is taken of (verl's bound, for the policy ratio and the k3 KL).
LOG_RATIO_BOUND = 20.0


def bounded_log_ratio(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``log p - log q`` clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (no gradient beyond); a token outside
    both policies' top-k / top-p sets (``-inf - -inf``) counts as no change."""
    return (log_p - log_q).nan_to_num(nan=0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def log_ratios(log_probs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``[B, T]`` bounded log ratios (:func:`bounded_log_ratio`): each token's own (``token``), or its sequence's
    mean over the masked tokens (``sequence``, GSPO), whose gradient reaches every token's log-prob."""
    log_ratio = bounded_log_ratio(log_probs, old)
    if level == "token":
        return log_ratio
    if level != "sequence":
        raise ValueError(f"importance_level {level!r}: expected token or sequence")
    weights = mask.to(log_ratio.dtype)
    sequence = (log_ratio * weights).sum(-1, keepdim=True) / weights.sum(-1, keepdim=True).clamp(min=1.0)
    return sequence.expand_as(log_ratio)


def importance_weights(
    trainer: torch.Tensor, sampler: torch.Tensor, kind: str, *, cap: float, threshold: float
) -> torch.Tensor:
    """Per-token weights ``w`` turning the sampler's token distribution ``q`` into the trainer's ``p``
    (log-probs ``[B, T]``; see the module docstring). Detached: they weigh the loss, not its gradient's path."""
    trainer, sampler = trainer.detach().double(), sampler.detach().double()
    ratio = torch.exp(trainer - sampler)
    if kind == "tis":
        weights = ratio.clamp(max=cap)
    elif kind == "mis":
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    elif kind == "cis":
        # log q - log(1 - q), finite for q < 1; a token the sampler was certain of has no displacement to cut
        logit_q = sampler - torch.log1p(-torch.exp(sampler).clamp(max=1 - 1e-12))
        capped = F.logsigmoid(logit_q + threshold)
        weights = torch.exp(torch.minimum(trainer, capped) - sampler)
    else:
        raise ValueError(f"importance_correction {kind!r}: expected tis, mis or cis")
    return weights.float()


def old_log_probs(
    ctx: ObjectiveContext, rollout: Rollout, log_probs: Callable[[Rollout], torch.Tensor]
) -> torch.Tensor:
    """``log_probs`` of the whole rollout before its first update (the old policy of its ratios), computed a
    minibatch at a time as the updates will, without gradients."""
    size = len(rollout) // ctx.minibatches
    with torch.no_grad():
        return torch.cat([log_probs(rollout.select(slice(b, b + size))) for b in range(0, len(rollout), size)])


class TokenGRPOObjective:
    """Clipped-ratio policy gradient over a rollout's completion tokens."""

    requires_log_prob = True
    transitions = "tokens"
    kl_regularizer = "token_kl"  # what `kl_beta` selects
    prepares = True  # prepare(): the loss mask, old log-probs and dapo's token count, once per rollout

    def __init__(self, options: TokenGRPOOptions, context: BuildContext) -> None:
        self.options = options
        self.eps_low = options.epsilon
        self.eps_high = options.epsilon_high if options.epsilon_high is not None else options.epsilon

    def prepare(self, ctx: ObjectiveContext, rollout: Rollout) -> None:
        """Before the rollout's first update: which tokens count, the old policy's log-probs when several
        updates share the rollout or the sampler's need correcting, and dapo's global token count."""
        o = self.options
        mask = rollout.mask.bool()
        if o.overlong_filter:
            mask = mask & ~rollout.truncated.to(mask.device)[:, None]
        rollout.extras["loss_mask"] = mask
        if ctx.minibatches * ctx.passes > 1 or o.importance_correction != "none":
            old = rollout.extras["old_log_probs"] = old_log_probs(ctx, rollout, ctx.backbone.token_log_probs)
            if o.importance_correction != "none":
                rollout.extras["is_weights"] = importance_weights(
                    old, rollout.log_probs, o.importance_correction, cap=o.correction_cap, threshold=o.cis_threshold
                )
        if o.loss_type == "dapo":
            tokens = mask.sum().float().reshape(1)
            acc = ctx.accelerator
            total = float(acc.gather(tokens).sum()) if acc is not None and acc.num_processes > 1 else float(tokens)
            processes = acc.num_processes if acc is not None else 1
            rollout.extras["dapo_normaliser"] = total / (processes * ctx.minibatches)

    def micro_steps(self, rollout: Rollout, step: int) -> list[int]:
        """One forward over every completion token of the minibatch."""
        return [0]

    def aggregator(self, ctx: ObjectiveContext, rollout: Rollout) -> Callable[[torch.Tensor], torch.Tensor]:
        """Per-token values ``[B, T]`` to this objective's loss (regularizers use it for their terms too)."""
        o = self.options
        return partial(
            aggregate_tokens,
            mask=rollout.extras["loss_mask"],
            loss_type=o.loss_type,
            max_length=o.max_completion_length or ctx.backbone.max_new_tokens,
            normaliser=rollout.extras.get("dapo_normaliser"),
        )

    def loss(self, ctx: ObjectiveContext, rollout: Rollout, micro_step: int) -> LossOutput:
        if rollout.advantages is None or "loss_mask" not in rollout.extras:
            raise ValueError("token_grpo needs a prepared rollout with advantages")
        log_probs = ctx.backbone.token_log_probs(rollout)
        old = rollout.extras.get("old_log_probs", log_probs.detach())
        log_ratio = log_ratios(log_probs, old, rollout.extras["loss_mask"], self.options.importance_level)
        per_token, ratio = clipped_ratio_loss(
            log_ratio, rollout.advantages[:, None].to(log_probs), self.eps_low, self.eps_high
        )
        if "is_weights" in rollout.extras:
            per_token = per_token * rollout.extras["is_weights"]
        aggregate = self.aggregator(ctx, rollout)
        policy_loss = aggregate(per_token)
        mask = rollout.extras["loss_mask"]
        tokens = mask.sum().clamp(min=1)

        def masked_mean(values: torch.Tensor) -> torch.Tensor:
            return (values.detach() * mask).sum() / tokens

        outside = clipped(ratio, self.eps_low, self.eps_high).float()
        metrics = {
            "policy_loss": policy_loss.detach(),
            "ratio": masked_mean(ratio),
            "clip_fraction": masked_mean(outside),
            "approx_kl": masked_mean(0.5 * log_ratio**2),
            "completion_tokens": mask.sum(-1).float().mean(),
        }
        if "is_weights" in rollout.extras:
            metrics["is_weight"] = masked_mean(rollout.extras["is_weights"])
        return LossOutput(
            loss=policy_loss, metrics=metrics, outputs={"log_probs": log_probs, "mask": mask, "aggregate": aggregate}
        )


@hookimpl
def gyremedia_register_objectives(register):
    register(
        "token_grpo",
        TokenGRPOObjective,
        options=TokenGRPOOptions,
        description="GRPO on tokens: grpo/bnpo/dr_grpo/dapo aggregation, clip-higher, k3 KL, TIS/MIS/CIS",
    )
