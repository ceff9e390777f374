"""DDPO's per-prompt reward statistics: a prompt's advantages come from its last ``advantage.history`` rewards
over all steps (this step's group included), the whole batch's until it has ``advantage.min_count`` of them."""

from __future__ import annotations

from typing import Any, Callable

import torch

from gyremedia import hookimpl
from gyremedia.stages.rollout import group_prompts
from gyremedia.state import TrainState


class PromptStatTracker:
    """DDPO's per-prompt statistics: every prompt's last ``history`` total rewards, over all steps.

    A sample's advantage is ``(r - mean) / (std + eps)`` over its prompt's buffer (this step's rewards
    added first), or over the whole batch while the buffer holds fewer than ``min_count`` rewards; with
    ``std="none"`` it is only centred. Dropped samples (NaN) get 0 and join no buffer. Every process
    sees the same gathered batch in the same order, so their buffers stay identical.
    """

    def __init__(self, history: int, min_count: int, std: str = "group", eps: float = 1e-4) -> None:
        if std not in ("group", "none"):
            raise ValueError(f"advantage std {std!r} with a reward history: expected group or none")
        self.history, self.min_count, self.std, self.eps = history, min_count, std, eps
        self.buffers: dict[str, list[float]] = {}

    def __call__(self, totals: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        totals = totals.double()
        valid = torch.isfinite(totals)
        advantages = torch.zeros_like(totals)
        batch = totals[valid]
        for prompt in dict.fromkeys(prompts):
            rows = torch.tensor([p == prompt for p in prompts], device=totals.device) & valid
            buffer = (self.buffers.get(prompt, []) + totals[rows].tolist())[-self.history :]
            self.buffers[prompt] = buffer
            reference = torch.tensor(buffer, dtype=totals.dtype) if len(buffer) >= self.min_count else batch.cpu()
            centred = totals[rows] - reference.mean().item()
            scale = reference.std(unbiased=False).item() + self.eps if self.std == "group" else 1.0
            advantages[rows] = centred / scale
        return advantages.float()

    def state_dict(self) -> dict[str, Any]:
        # str(): a prompt record's text (a checkpoint holds plain values; its fields are the data's, not state)
        return {"buffers": {str(prompt): list(buffer) for prompt, buffer in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {prompt: list(buffer) for prompt, buffer in state.get("buffers", {}).items()}


@hookimpl
def gyremedia_check_config(core: Any, selected: dict[str, Any]) -> list[str]:
    adv, errors = core.advantage, []
    if adv.history and adv.combine != "sum":
        errors.append(
            f"advantage.history={adv.history} keeps each prompt's total reward: use advantage.combine=sum "
            f"(or advantage.history=0 with combine={adv.combine})"
        )
    if adv.history and adv.std == "global":
        errors.append(
            f"advantage.history={adv.history} normalises by each prompt's own history: use advantage.std=group "
            f"or none (or advantage.history=0 with std=global)"
        )
    if adv.history and adv.min_count > adv.history:
        errors.append(
            f"advantage.min_count={adv.min_count} can never be reached by a history of {adv.history}: "
            f"set advantage.min_count to at most {adv.history}"
        )
    return errors


@hookimpl
def gyremedia_setup(state: TrainState, context: Any) -> None:
    adv = state.config.core.advantage
    if adv.history:
        tracker = PromptStatTracker(adv.history, adv.min_count, adv.std, adv.eps)
        state.stateful["advantage"] = tracker  # checkpointed under the name it has always had
        state.plugins.register_for_run(PromptHistory(tracker), name="prompt_history:run")


class PromptHistory:
    """Normalises each step's rewards by their prompts' histories instead of their groups."""

    def __init__(self, tracker: PromptStatTracker) -> None:
        self.tracker = tracker

    @hookimpl
    def gyremedia_group_statistics(
        self, state: TrainState, step: int
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        prompts = group_prompts(state, step)  # keyed by the prompt, not the step's group

        def normalize(totals: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
            return self.tracker(totals, [prompts[g] for g in groups.tolist()])

        return normalize
