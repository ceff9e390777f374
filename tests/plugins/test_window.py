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


def test_progressive_window_matches_mixgrpo_on_a_hand_worked_example():
    # 10 steps: MixGRPO's max_timesteps = 10 - 2 = 8, so indices 8 and 9 are never stochastic. Window 4,
    # shift interval 2, stride 1: two training steps at each start 0..7, the window cut off before index 8,
    # then back to the start.
    expected = [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7], [6, 7], [7]]
    assert [window_at(k, size=4, shift_every=2) for k in range(0, 16, 2)] == expected
    assert [window_at(k, size=4, shift_every=2) for k in range(1, 16, 2)] == expected
    assert window_at(16, size=4, shift_every=2) == [0, 1, 2, 3]
    assert window_at(2, size=4, shift_every=2, stride=4) == [4, 5, 6, 7]  # MixGRPO without overlap: stride = size
    assert max(i for k in range(40) for i in window_at(k, size=3, shift_every=1)) == 7


def test_decay_shortens_the_shift_interval_and_keeps_the_window_size():
    # MixGRPO's decay: interval(start) = max(min, int(max (1 - start/8) + min start/8)) with max 4, min 1:
    # 4, 3, 3, 2, 2, 2, 1, 1 training steps at starts 0 .. 7 (18 in all), then back to the start.
    starts = [window_at(k, size=4, shift_every=4, min_shift_every=1, schedule="decay")[0] for k in range(22)]
    assert starts == [0] * 4 + [1] * 3 + [2] * 3 + [3] * 2 + [4] * 2 + [5] * 2 + [6] + [7] + [0] * 4
    assert window_at(12, size=4, shift_every=4, schedule="decay") == [4, 5, 6, 7]  # still 4 wide
    assert "min_shift_every" in validate(WindowOptions(shift_every=2, min_shift_every=3))[0]


def test_fixed_and_random_windows():
    assert window_at(99, size=3, schedule="fixed") == [0, 1, 2]
    randoms = {tuple(window_at(k, size=3, schedule="random")) for k in range(40)}
    assert len(randoms) > 1 and all(len(w) == 3 and max(w) <= 7 for w in randoms)
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
    config = make_config(
        "sampler={name: window, size: 1, schedule: progressive, shift_every: 1}",
        "train.steps=3",
        "rollout.num_steps=4",
        "objective.timestep_fraction=1.0",
    )
    state = Trainer(config, PluginManager()).train()
    # 4 steps: the window may sit at index 0 or 1 (never the last two); training step 2 rolled back to 0
    log_probs = state.rollout.log_probs
    assert torch.isfinite(log_probs[:, 0]).all() and log_probs[:, 1:].isnan().all()
    assert state.objective.micro_steps(state.rollout, 2) == [0]
    assert state.last_metrics["ratio"] == 1.0 and state.last_metrics["sampler/window_start"] == 1.0  # step 3's
