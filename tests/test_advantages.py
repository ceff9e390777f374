"""Group-relative advantages: by hand, zero mean per group, and gathered over ranks."""

import pytest
import torch
from accelerate import Accelerator

from gyremedia.advantages import combined_advantages, distributed_group_advantages, group_advantages
from gyremedia_features.prompt_history import PromptStatTracker


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    std = torch.tensor([1.0, 2.0, 3.0, 4.0]).std(unbiased=False).item()  # population std, as Flow-GRPO
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0]) / torch.tensor([std + 1e-4] * 4 + [1e-4] * 4)
    torch.testing.assert_close(group_advantages(rewards, groups), expected)


def test_advantages_have_zero_mean_per_group():
    torch.manual_seed(0)
    rewards, groups = torch.randn(24), torch.arange(24) // 6
    advantages = group_advantages(rewards, groups)
    for g in range(4):
        assert abs(advantages[groups == g].mean().item()) < 1e-6
        assert advantages[groups == g].std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)


def test_global_and_no_std():
    rewards, groups = torch.tensor([0.0, 2.0, 10.0, 14.0]), torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(group_advantages(rewards, groups, std="none"), torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    scale = rewards.std(unbiased=False).item() + 1e-4
    torch.testing.assert_close(
        group_advantages(rewards, groups, std="global"), torch.tensor([-1.0, 1.0, -2.0, 2.0]) / scale
    )
    with pytest.raises(ValueError, match="expected group, global or none"):
        group_advantages(rewards, groups, std="rank")


def test_distributed_matches_plain_on_one_process_with_any_sample_order():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1)
    rewards, groups = torch.randn(8), torch.arange(8) // 4
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    local, gathered, _ = distributed_group_advantages(
        accelerator, rewards[order, None], torch.ones(1), groups[order], order
    )
    torch.testing.assert_close(local, group_advantages(rewards, groups)[order])
    torch.testing.assert_close(gathered, rewards)  # every rank's rewards, ordered by sample id


def test_dropped_samples_get_zero_advantage_and_leave_the_group_statistics():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 100.0, 5.0, 7.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    rewards[3] = float("nan")
    advantages = group_advantages(rewards, groups)
    # group 0 is normalised over {1, 3} alone; the dropped samples get 0
    torch.testing.assert_close(advantages[:4], torch.tensor([-1.0, 0.0, 1.0, 0.0]) / (1 + 1e-4))
    torch.testing.assert_close(advantages[4:], torch.tensor([-1.0, 1.0]) / (1 + 1e-4))
    all_dropped = group_advantages(torch.full((2,), float("nan")), torch.tensor([0, 0]))
    assert torch.equal(all_dropped, torch.zeros(2))


def test_normalize_each_lets_a_small_scale_reward_count():
    # reward A separates the samples by 1000x more than reward B, in the opposite order
    a = torch.tensor([0.0, 1000.0, 0.0, 1000.0])
    b = torch.tensor([1.0, 0.0, 1.0, 0.0])
    groups, weights = torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 2.0])
    rewards = torch.stack([a, b], dim=1)
    summed = combined_advantages(rewards, weights, groups, "sum")
    each = combined_advantages(rewards, weights, groups, "normalize_each")
    assert summed[1] > 0.99  # the large reward decides alone
    torch.testing.assert_close(
        each, weights[0] * group_advantages(a, groups) + weights[1] * group_advantages(b, groups)
    )
    assert each[0] > 0.99 and each[1] < -0.99  # B's weight 2 now wins
    rewards[0, 1] = float("nan")  # a NaN in any reward drops the sample from all of them
    assert combined_advantages(rewards, weights, groups, "normalize_each")[0] == 0
    with pytest.raises(ValueError, match="sum or normalize_each"):
        combined_advantages(rewards, weights, groups, "max")


def test_prompt_stat_tracker_uses_the_batch_until_a_prompt_has_enough_history():
    tracker = PromptStatTracker(history=4, min_count=3, eps=0.0)
    # step 1: two rewards of each prompt, fewer than min_count -> the batch's mean 2.5 and std sqrt(1.25)
    first = tracker(torch.tensor([1.0, 2.0, 3.0, 4.0]), ["a", "a", "b", "b"])
    torch.testing.assert_close(first, (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / 1.25**0.5)
    # step 2: "a" now has [1, 2, 5, 7] (4 >= 3 rewards) -> its own mean and std
    second = tracker(torch.tensor([5.0, 7.0, float("nan"), 0.0]), ["a", "a", "c", "c"])
    history = torch.tensor([1.0, 2.0, 5.0, 7.0])
    expected_a = (torch.tensor([5.0, 7.0]) - history.mean()) / history.std(unbiased=False)
    torch.testing.assert_close(second[:2], expected_a)
    assert second[2] == 0.0 and tracker.buffers["c"] == [0.0]  # a dropped sample joins no buffer
    batch = torch.tensor([5.0, 7.0, 0.0])  # "c" has one reward: the batch's statistics, without the NaN
    assert second[3].item() == pytest.approx(((0.0 - batch.mean()) / batch.std(unbiased=False)).item())
    tracker(torch.tensor([9.0]), ["a"])
    assert tracker.buffers["a"] == [2.0, 5.0, 7.0, 9.0]  # the last `history` rewards
    restored = PromptStatTracker(history=4, min_count=3)
    restored.load_state_dict(tracker.state_dict())
    assert restored.buffers == tracker.buffers
