"""MixGRPO's ODE/SDE window: where it sits over training, and GRPO training only inside it."""

from __future__ import annotations

import torch

from gyremedia.options import validate
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer
from gyremedia_samplers.window import WindowOptions, WindowSampler


def window_at(train_step: int, **options) -> list[int]:
    sampler = WindowSampler(WindowOptions(**options))
    sampler.train_step = train_step
    return list(sampler.window(10))


def test_schedules_move_the_window_as_training_goes():
    assert window_at(0, size=3, shift_every=5) == [0, 1, 2]
    assert window_at(12, size=3, shift_every=5) == [2, 3, 4]  # progressive: one step later every 5
    assert window_at(5 * 8, size=3, shift_every=5) == [0, 1, 2]  # wraps after the last position (7)
    assert window_at(12, size=3, shift_every=5, schedule="decay") == [0]
    assert window_at(4, size=3, shift_every=5, schedule="decay") == [0, 1, 2]
    assert window_at(99, size=3, schedule="fixed") == [0, 1, 2]
    randoms = {tuple(window_at(k, size=3, schedule="random")) for k in range(20)}
    assert len(randoms) > 1 and all(len(w) == 3 for w in randoms)
    assert window_at(7, size=3, schedule="random") == window_at(7, size=3, schedule="random")  # seeded


def test_steps_outside_the_window_are_ode_steps_without_log_probs():
    sampler = WindowSampler(WindowOptions(size=2, schedule="fixed"))
    sigmas = torch.linspace(1, 0, 5)
    x, v, noise = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    inside = sampler.step(x, v, sigmas, 1, noise=noise)
    outside = sampler.step(x, v, sigmas, 2, noise=noise)
    assert torch.isfinite(inside.log_prob).all() and outside.log_prob.isnan().all()
    torch.testing.assert_close(outside.next_state, x + (sigmas[3] - sigmas[2]) * v)
    # replay of a recorded transition always scores it under the SDE kernel
    assert torch.isfinite(sampler.step(x, v, sigmas, 2, next_state=outside.next_state).log_prob).all()
    assert "expected one of progressive, decay, random, fixed" in validate(WindowOptions(schedule="sometimes"))[0]


def test_grpo_trains_only_inside_the_window(make_config):
    config = make_config("sampler={name: window, size: 1, schedule: progressive, shift_every: 1}", "train.steps=3",
                         "objective.timestep_fraction=1.0")
    state = Trainer(config, PluginManager()).train()
    log_probs = state.rollout.log_probs  # the last rollout (training step 2): window at index 2 of 3
    assert torch.isfinite(log_probs[:, 2]).all() and log_probs[:, :2].isnan().all()
    assert state.objective.micro_steps(state.rollout, 2) == [2]
    assert state.last_metrics["ratio"] == 1.0 and state.last_metrics["sampler/window_start"] == 0.0  # wrapped
