"""Sol-RL's two-stage rollouts: the contrastive subset of a scored pool, and the trainer sampling exactly the
chosen candidates' noises again at full quality."""

from __future__ import annotations

import math

import pytest
import torch

from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.runtime.streams import Stream, sample_generators
from gyremedia.stages.rollout import rollout_request
from gyremedia.trainer import Trainer
from gyremedia_features.candidates import CandidatePools, contrastive_subset


def test_the_contrastive_subset_is_each_groups_best_and_worst():
    rewards = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.7, 0.2], [0.4, float("nan"), 0.4, 0.8, 0.0, 0.6]])
    assert contrastive_subset(rewards, 4).tolist() == [[1, 4, 5, 0], [3, 5, 4, 1]]  # a failed score ranks last
    assert contrastive_subset(rewards, 3).tolist() == [[1, 4, 0], [3, 5, 1]]  # odd: one more of the best
    assert contrastive_subset(rewards[:, :2], 2).tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ValueError, match="keep=7 of 6"):
        contrastive_subset(rewards, 7)


class PoolSpy:
    """Wraps a reward: keeps the scores of every call (the first one of a step is the candidate pool's)."""

    def __init__(self, reward) -> None:
        self.reward, self.calls = reward, []

    def __call__(self, media, prompts):
        scores = self.reward(media, prompts)
        self.calls.append(scores["score"].clone())
        return scores


def test_the_rollout_starts_from_the_chosen_candidates_noises(make_config):
    trainer = Trainer(
        make_config("rollout.candidates=12", "rollout.candidate_steps=2", "train.steps=1"), PluginManager()
    )
    state = trainer.setup()
    spy = state.rewards["jpeg_compressibility"] = PoolSpy(state.rewards["jpeg_compressibility"])
    state.scorer.rewards["jpeg_compressibility"] = spy
    request = rollout_request(state, 0)
    CandidatePools().gyremedia_prepare_request(state, request)
    pool_mean = request.metrics["rollout/candidate_reward"]
    pool = spy.calls[0].reshape(2, 12)  # 2 groups of 12 candidates
    assert pool_mean == pytest.approx(pool.mean().item())
    keys = torch.arange(24).reshape(2, 12)  # group g's candidate j has noise key 12 g + j
    expected = keys.gather(1, contrastive_subset(pool, 4)).flatten()
    assert request.noise_stream == Stream.CANDIDATES and request.noise_ids.tolist() == expected.tolist()
    best, worst = pool.sort(dim=1, descending=True).values[:, :2], pool.sort(dim=1).values[:, :2]
    chosen = pool.flatten()[expected].reshape(2, 4)
    assert torch.equal(chosen[:, :2], best) and torch.equal(chosen[:, 2:].sort(dim=1).values, worst)

    rollout = state.plugins.hook.gyremedia_collect_rollout(state=state, request=request)
    noise = state.backbone.sample_noise(sample_generators(0, 0, Stream.CANDIDATES, expected.tolist()))
    assert torch.equal(rollout.states[:, 0], noise)  # full-quality samples from exactly those noises
    assert rollout.states.shape[1] == 4  # rollout.num_steps=3 transitions, not the candidates' 2


def test_a_two_stage_run_trains_on_policy_and_reports_the_pool(make_config):
    metrics = Trainer(make_config("rollout.candidates=8", "train.steps=1"), PluginManager()).train().last_metrics
    assert metrics["ratio"] == 1.0 and math.isfinite(metrics["rollout/candidate_reward"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.candidates=6"], "draw a larger multiple of rollout.group_size=4"),
        (["rollout.candidates=4"], "draw a larger multiple of rollout.group_size=4"),
        (
            ["rollout.candidates=8", "rollout.branch_steps=[0, 1]"],
            "set rollout.branch_steps=[] or rollout.candidates=0",
        ),
    ],
)
def test_bad_candidate_settings_fail_at_config_time(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
        make_config(*overrides)
