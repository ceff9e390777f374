"""Calling rewards: batching, coroutines, timeouts and the fail/drop policies."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from gyremedia.config import RewardSettings, Selected
from gyremedia.rollout import Media
from gyremedia.scoring import RewardError, Scorer, call_reward

PROMPTS = [f"prompt {i}" for i in range(8)]
MEDIA = Media("image", torch.arange(8.0).reshape(8, 1, 1, 1).expand(8, 3, 2, 2))


class Brightness:
    """Mean pixel value; records the size of every call."""

    kinds = {"image"}

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size = batch_size
        self.calls: list[int] = []

    def __call__(self, media, prompts):
        self.calls.append(len(prompts))
        return {"score": media.data.mean(dim=(1, 2, 3)), "count": torch.ones(len(prompts))}


def selected(name: str, **settings) -> Selected:
    return Selected("reward", name, None, RewardSettings(**settings))


def test_batched_reward_is_called_in_chunks_and_equals_unbatched():
    batched, whole = Brightness(batch_size=3), Brightness()
    assert torch.equal(call_reward(batched, MEDIA, PROMPTS)["score"], call_reward(whole, MEDIA, PROMPTS)["score"])
    assert batched.calls == [3, 3, 2] and whole.calls == [8]


def test_async_reward_chunks_are_awaited_concurrently():
    class Remote:
        kinds, batch_size = {"image"}, 2

        async def __call__(self, media, prompts):
            await asyncio.sleep(0.3)
            return media.data.mean(dim=(1, 2, 3))

    start = time.perf_counter()
    scores = call_reward(Remote(), MEDIA, PROMPTS)
    assert time.perf_counter() - start < 0.9  # four 0.3 s chunks at once, not 1.2 s in a row
    assert torch.equal(scores["score"], torch.arange(8.0))


class Failing:
    kinds = {"image"}

    def __init__(self, how: str) -> None:
        self.how = how

    def __call__(self, media, prompts):
        if self.how == "raise":
            raise ConnectionError("judge unreachable")
        if self.how == "sleep":
            time.sleep(3)
        scores = torch.ones(len(prompts))
        if self.how == "nan":
            scores[5] = float("nan")
        if self.how == "no_score":
            return {"value": scores}
        if self.how == "reserved":
            return {"score": scores, "dropped": scores}
        return scores


def score_with(how: str, **settings):
    scorer = Scorer([selected("flaky", **settings)], {"flaky": Failing(how)})
    return scorer.collect(scorer.submit(MEDIA, PROMPTS), PROMPTS, step=7)


def test_fail_policy_names_reward_step_and_prompt():
    with pytest.raises(
        RewardError, match="reward 'flaky' failed at step 7 on prompts .*ConnectionError: judge unreachable"
    ):
        score_with("raise")
    with pytest.raises(RewardError, match="reward 'flaky' failed at step 7 on prompt 'prompt 5': 'score' is nan"):
        score_with("nan")


def test_drop_policy_marks_failed_samples_and_never_zeros_them():
    scored = score_with("raise", on_failure="drop")
    assert scored.dropped["flaky"].all() and scored.components["flaky"]["score"].isnan().all()
    scored = score_with("nan", on_failure="drop")
    assert scored.dropped["flaky"].tolist() == [i == 5 for i in range(8)]
    assert scored.components["flaky"]["score"][5].isnan() and scored.components["flaky"]["score"][4] == 1.0


def test_malformed_output_fails_even_under_drop():
    with pytest.raises(RewardError, match="returned keys \\['value'\\] without a 'score'"):
        score_with("no_score", on_failure="drop")
    with pytest.raises(RewardError, match="component named 'dropped'.*rename it"):
        score_with("reserved", on_failure="drop")


def test_timeout_drops_the_call_and_later_calls_do_not_queue_behind_it():
    reward = Failing("sleep")
    scorer = Scorer([selected("slow", on_failure="drop", timeout=0.3)], {"slow": reward})
    start = time.perf_counter()
    scored = scorer.collect(scorer.submit(MEDIA, PROMPTS), PROMPTS, step=0)
    assert time.perf_counter() - start < 1.5 and scored.dropped["slow"].all()
    reward.how = "ok"
    scored = scorer.collect(scorer.submit(MEDIA, PROMPTS), PROMPTS, step=1)  # a fresh worker, not the hung one
    assert not scored.dropped["slow"].any() and time.perf_counter() - start < 2.5
    with pytest.raises(RewardError, match="no answer within timeout=0.3 s"):
        score_with("sleep", timeout=0.3)


def test_rewards_run_in_parallel_threads():
    barrier = threading.Barrier(2, timeout=5)

    class Meeting:
        kinds = {"image"}

        def __call__(self, media, prompts):
            barrier.wait()  # only returns if the other reward is running at the same time
            return torch.zeros(len(prompts))

    scorer = Scorer([selected("a"), selected("b")], {"a": Meeting(), "b": Meeting()})
    scored = scorer.collect(scorer.submit(MEDIA, PROMPTS), PROMPTS, step=0)
    assert set(scored.components) == {"a", "b"}


def test_one_rewards_calls_run_one_at_a_time_in_order():
    """Batches submitted before the last is scored (async scoring) queue per reward: a reward need not be
    thread-safe; different rewards still run at once (above)."""
    calls, running = [], []

    class Recording:
        kinds = {"image"}

        def __call__(self, media, prompts):
            running.append(1)
            calls.append((prompts[0], len(running)))
            time.sleep(0.05)
            running.pop()
            return torch.zeros(len(prompts))

    scorer = Scorer([selected("r")], {"r": Recording()})
    futures = [scorer.submit(MEDIA, [f"batch {i}"] * len(PROMPTS)) for i in range(4)]
    for i, submitted in enumerate(futures):
        scorer.collect(submitted, PROMPTS, step=i)
    assert calls == [(f"batch {i}", 1) for i in range(4)]


def test_a_reward_thread_ends_with_its_call():
    """No worker outlives its call: one that ran parallel torch ops would keep an OpenMP thread team, which
    slows every later parallel op of the trainer on a CPU with GNU OpenMP (``in_own_thread``)."""
    scorer = Scorer([selected("a"), selected("b")], {"a": Failing("ok"), "b": Failing("ok")})
    scorer.collect(scorer.submit(MEDIA, PROMPTS), PROMPTS, step=0)
    workers = [t for t in threading.enumerate() if t.name.startswith("gyremedia-reward")]
    for worker in workers:
        worker.join(timeout=5)
    assert not [t for t in workers if t.is_alive()]
