"""Calling rewards: batching, coroutines, timeouts and the failure policy, for training and evaluation.

A reward is ``reward(media, prompts) -> dict[str, Tensor[B]] | Tensor[B]`` (see
:class:`gyremedia.interfaces.Reward`). It may declare ``batch_size`` (the core then calls it on
chunks of at most that many samples) and may be a coroutine function (``async def __call__``; its
chunks are awaited concurrently). In training each call of a selected reward runs in a thread of its own
(one reward's calls in order, one at a time), so slow rewards (a remote judge, OCR) score in parallel with each other and, with
``rollout.async_scoring``, with the sampling of the next rollout.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from gyremedia.config import Selected
from gyremedia.interfaces import reward_components
from gyremedia.rollout import Media
from gyremedia.runtime.threads import in_own_thread

logger = logging.getLogger("gyremedia")


class RewardError(RuntimeError):
    """A reward raised, timed out, or returned a non-finite or malformed score."""

    exit_code = 1


class RewardContractError(RewardError):
    """A reward returned the wrong keys or shapes: a bug in the reward, fatal under every failure policy."""

    exit_code = 2


class MalformedRewardOutput(ValueError):
    """What :func:`call_reward` raises for output that breaks the reward contract."""


#: What every reward returns (:class:`gyremedia.interfaces.Reward`), quoted in the errors that break it.
REWARD_CONTRACT = (
    "a reward returns a Tensor[B], or a dict of Tensor[B] holding a 'score' (its other entries are "
    "logged as components, except 'frames', a video reward's per-frame scores Tensor[B, T])"
)
#: The component holding a video reward's per-frame scores ``[B, T]`` (their mean over frames is the score): what
#: per-frame advantages (``advantage.per_frame``) are computed from.
FRAME_SCORES = "frames"


#: Component names a reward may not return: the trainer logs ``reward/<name>/dropped`` itself.
RESERVED_COMPONENTS = frozenset({"dropped"})


def call_reward(reward: Any, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
    """One reward's components for a batch, as float32 CPU tensors ``[B]`` (shapes checked)."""
    size = int(getattr(reward, "batch_size", None) or len(prompts)) or 1
    outputs = [
        reward(media.select(slice(begin, begin + size)), prompts[begin : begin + size])
        for begin in range(0, len(prompts), size)
    ]
    pending = [i for i, out in enumerate(outputs) if inspect.isawaitable(out)]
    if pending:

        async def wait_all() -> list[Any]:
            return await asyncio.gather(*(outputs[i] for i in pending))

        for i, out in zip(pending, asyncio.run(wait_all())):
            outputs[i] = out
    parts = [reward_components(out) for out in outputs]
    keys = set(parts[0])
    if "score" not in keys:
        raise MalformedRewardOutput(f"returned keys {sorted(keys)} without a 'score': {REWARD_CONTRACT}")
    if any(set(p) != keys for p in parts):
        raise MalformedRewardOutput(f"returned different keys for different chunks of the batch: {REWARD_CONTRACT}")
    reserved = keys & RESERVED_COMPONENTS
    if reserved:
        raise MalformedRewardOutput(
            f"returned a component named {sorted(reserved)[0]!r}, a name the trainer uses for "
            "its own per-reward metrics: rename it"
        )
    components = {}
    for key in parts[0]:
        chunks = [torch.as_tensor(p[key], dtype=torch.float32).detach().cpu() for p in parts]
        shapes = [tuple(chunk.shape) for chunk in chunks]
        dims = 2 if key == FRAME_SCORES else 1
        if sum(s[0] if s else 1 for s in shapes) != len(prompts) or any(len(s) != dims for s in shapes):
            raise MalformedRewardOutput(
                f"'{key}' has shape {shapes[0] if len(shapes) == 1 else shapes}, expected "
                f"({len(prompts)}{', T' if dims == 2 else ','}): {REWARD_CONTRACT}"
            )
        components[key] = torch.cat(chunks)
    return components


@dataclass
class ScoredBatch:
    """Every selected reward's components for one batch; ``dropped[name]`` marks dropped samples."""

    components: dict[str, dict[str, torch.Tensor]]
    dropped: dict[str, torch.Tensor]


class Scorer:
    """Runs the selected rewards on a batch in worker threads and applies each one's failure policy.

    ``submit`` returns at once; ``collect`` waits (up to each reward's ``timeout``) and either
    raises :class:`RewardError` (``on_failure: fail``) or marks the failed samples as dropped
    (``on_failure: drop``: their score becomes NaN, which the advantages leave out).
    """

    def __init__(self, selected: list[Selected], rewards: dict[str, Any]) -> None:
        self.selected = selected
        self.rewards = rewards
        self._latest: dict[str, Future] = {}  # each reward's last call: its next one starts after it

    def may_drop(self, name: str) -> bool:
        """Whether reward ``name`` drops failed samples (and so reports a dropped count)."""
        return any(s.name == name and s.settings.on_failure == "drop" for s in self.selected)

    def submit(self, media: Media, prompts: list[str]) -> dict[str, tuple[Future, float]]:
        """Start every reward on the batch; returns their futures with their start times.

        Different rewards run at once; one reward's calls run one at a time, in order (a reward need not be
        thread-safe), as with ``rollout.async_scoring`` a batch can be submitted before the last one is scored.
        """
        futures = {}
        for s in self.selected:
            self._latest[s.name] = in_own_thread(
                call_reward,
                self.rewards[s.name],
                media,
                prompts,
                after=self._latest.get(s.name),
                name="gyremedia-reward",
            )
            futures[s.name] = (self._latest[s.name], time.monotonic())
        return futures

    def collect(self, futures: dict[str, tuple[Future, float]], prompts: list[str], step: int | str) -> ScoredBatch:
        """Wait for the futures of :meth:`submit` and apply the failure policies (``step``: the step, or a stage
        such as "in the step-25 evaluation", for the messages)."""
        components, dropped = {}, {}
        for s in self.selected:
            future, started = futures[s.name]
            policy, timeout = s.settings.on_failure, s.settings.timeout
            failed = torch.zeros(len(prompts), dtype=torch.bool)
            try:
                seconds_left = max(timeout - (time.monotonic() - started), 0.0) if timeout else None
                scores = future.result(timeout=seconds_left)
            except FutureTimeout:  # the hung call keeps its thread; calls submitted later do not wait for it
                if self._latest.get(s.name) is future:
                    del self._latest[s.name]
                scores = self._failed(s.name, step, prompts, f"no answer within timeout={timeout} s", policy)
                failed[:] = True
            except MalformedRewardOutput as exc:  # a bug in the reward, never a flaky sample
                raise RewardContractError(f"reward {s.name!r} {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - any reward failure is reported, by policy
                scores = self._failed(s.name, step, prompts, f"{type(exc).__name__}: {exc}", policy, exc)
                failed[:] = True
            for key, value in scores.items():
                # Only the score must be a number; a NaN component means "does not apply to this sample".
                bad = ~torch.isfinite(value) if key == "score" else torch.isinf(value)
                if bad.any() and (policy == "fail" or key != "score"):
                    index = int(bad.nonzero()[0])
                    raise reward_error(s.name, step, prompts, f"'{key}' is {value[index].item()}", index)
                if key == "score":
                    failed |= bad
            scores["score"] = scores["score"].masked_fill(failed, float("nan"))
            if FRAME_SCORES in scores:
                scores[FRAME_SCORES] = scores[FRAME_SCORES].masked_fill(failed[:, None], float("nan"))
            if failed.any():
                logger.warning(
                    "reward %r dropped %d of %d samples %s (first prompt %r)",
                    s.name,
                    int(failed.sum()),
                    len(prompts),
                    f"at step {step}" if isinstance(step, int) else step,
                    prompts[int(failed.nonzero()[0])],
                )
            components[s.name], dropped[s.name] = scores, failed
        return ScoredBatch(components, dropped)

    @staticmethod
    def _failed(
        name: str, step: int | str, prompts: list[str], why: str, policy: str, cause: BaseException | None = None
    ) -> dict[str, torch.Tensor]:
        """The whole call failed: raise, or return an all-NaN score to drop every sample."""
        if policy == "fail":
            raise reward_error(name, step, prompts, why) from cause
        return {"score": torch.full((len(prompts),), float("nan"))}


def reward_error(name: str, step: int | str, prompts: list[str], why: str, index: int | None = None) -> RewardError:
    """A :class:`RewardError` naming the reward, the step (or a stage: "in the step-25 evaluation") and the
    (first) prompt concerned."""
    where = f" on prompt {prompts[index]!r}" if index is not None else f" on prompts {prompts[:4]}"
    when = f"at step {step}" if isinstance(step, int) else step
    return RewardError(f"reward {name!r} failed {when}{where}: {why}")
