"""Group-relative advantages: by hand, zero mean per group, and gathered over ranks."""

import pytest
import torch
from accelerate import Accelerator

from gyremedia.advantages import combined_advantages, distributed_group_advantages, group_advantages


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
    torch.testing.assert_close(group_advantages(rewards, groups, std="global"),
                               torch.tensor([-1.0, 1.0, -2.0, 2.0]) / scale)
    with pytest.raises(ValueError, match="expected group, global or none"):
        group_advantages(rewards, groups, std="rank")


def test_distributed_matches_plain_on_one_process_with_any_sample_order():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1)
    rewards, groups = torch.randn(8), torch.arange(8) // 4
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    local, gathered, _ = distributed_group_advantages(accelerator, rewards[order, None], torch.ones(1),
                                                      groups[order], order)
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
    torch.testing.assert_close(each, weights[0] * group_advantages(a, groups) + weights[1] * group_advantages(b, groups))
    assert each[0] > 0.99 and each[1] < -0.99  # B's weight 2 now wins
    rewards[0, 1] = float("nan")  # a NaN in any reward drops the sample from all of them
    assert combined_advantages(rewards, weights, groups, "normalize_each")[0] == 0
    with pytest.raises(ValueError, match="sum or normalize_each"):
        combined_advantages(rewards, weights, groups, "max")
