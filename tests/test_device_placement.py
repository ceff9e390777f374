"""Every tensor the core and the first-party plugins create lands on the device of the data it meets.

A CPU-only machine cannot run CUDA, so these runs put the model and the data on a stand-in accelerator
(tests/fake_device.py: CPU memory that refuses to mix with CPU tensors, as CUDA does) and train a few
steps through the real trainer: rollout, rewards, advantages over ranks, objective, regularizers,
optimizer, evaluation, monitor and checkpoints.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from accelerate import Accelerator

from fake_device import DEVICE, DeviceMismatch, FakeDevice, OnDevice
from gyremedia.advantages import group_advantages
from gyremedia.config import ResolvedConfig
from gyremedia.plugins import PluginManager
from gyremedia.runtime.distributed import to_device, to_host
from gyremedia.stages import rollout
from gyremedia.stages.advantages import gyremedia_compute_advantages
from gyremedia.stages.scoring import gyremedia_score_rollout, start_scoring
from gyremedia.stages.update import gyremedia_update
from gyremedia.trainer import Trainer


class FakeDeviceAccelerator(Accelerator):
    """An accelerate ``Accelerator`` whose device is the stand-in accelerator."""

    @property
    def device(self) -> torch.device:
        return DEVICE


def test_the_stand_in_device_refuses_what_cuda_refuses():
    with FakeDevice():
        x = torch.ones(3).to(DEVICE)
        assert isinstance(x, OnDevice) and x.device == DEVICE
        assert (x + 1).sum().item() == 6.0  # computes, reads back scalars
        assert isinstance(torch.zeros(3, device=x.device), OnDevice)
        assert x[torch.tensor([0, 2])].tolist() == [1.0, 1.0]  # CPU index tensors are allowed, as on CUDA
        with pytest.raises(DeviceMismatch, match="index_add_"):
            torch.zeros(3).index_add_(0, torch.arange(3), x)  # the bug this file exists for


def test_group_advantages_stay_on_the_rewards_device():
    with FakeDevice():
        rewards = torch.tensor([1.0, 2.0, 3.0, float("nan")]).to(DEVICE)
        advantages = group_advantages(rewards, torch.tensor([0, 0, 1, 1]).to(DEVICE))
        assert isinstance(advantages, OnDevice)
        assert advantages.cpu().tolist()[-1] == 0.0


RUNS = {
    "grpo+flow_sde+gaussian_kl": [
        "objective={name: grpo, clip_range: 0.01, kl_beta: 0.1, timestep_fraction: 0.7}",
        "regularizers=[velocity_norm_hinge]",
    ],
    "nft+ode+velocity_kl": ["objective={name: nft, kl_beta: 0.1}", "sampler={name: ode}"],
    "awm+heun+ghuber": ["objective={name: awm}", "sampler={name: heun}", "weighting={name: ghuber}"],
    "vgrpo+dance_sde": ["objective={name: vgrpo}", "sampler={name: dance_sde}"],
    "pairwise+cps+dynamic": ["objective={name: pairwise}", "sampler={name: cps}", "weighting={name: dynamic}"],
    "window": ["sampler={name: window, size: 2, schedule: random}"],
    "encoders-on-cpu": ["backbone.text_encoders_on_cpu=true", "backbone.vae_slicing=true"],
    "tree_grpo": [
        "objective={name: tree_grpo, clip_range: 0.01, aggregate: logprob, normalize_depth: true, "
        "dedup: true, width: 1}",
        "rollout.branch_steps=[0, 1]",
    ],
    "pareto+monitor+async": [
        "rewards=[jpeg_compressibility, {name: jpeg_compressibility_2, on_failure: drop}]",
        "pareto.enabled=true",
        "backbone.preference_inputs=2",
        "advantage.combine=normalize_each",
        "monitor={drift: true, gold: [jpeg_compressibility]}",
        "rollout.async_scoring=true",
        "train.num_minibatches=2",
    ],
}


@pytest.fixture
def second_jpeg_reward():
    """A second registered reward (the same JPEG size), so a run can combine two."""
    from gyremedia import hookimpl
    from gyremedia_rewards.compressibility import JpegCompressibility, JpegOptions

    class SecondReward:
        @hookimpl
        def gyremedia_register_rewards(self, register):
            register("jpeg_compressibility_2", JpegCompressibility, options=JpegOptions)

    return PluginManager(extra_plugins=[SecondReward()])


@pytest.mark.parametrize("overrides", list(RUNS.values()), ids=list(RUNS))
def test_a_run_on_an_accelerator_keeps_every_tensor_there(make_config, second_jpeg_reward, overrides):
    if "rollout.branch_steps=[0, 1]" in overrides:
        overrides = [*overrides, "rollout.group_size=4"]
    config = make_config(*overrides, "train.steps=2", plugins=second_jpeg_reward)
    with FakeDevice():
        state = Trainer(config, second_jpeg_reward, accelerator=FakeDeviceAccelerator(cpu=True)).train()
    assert isinstance(next(state.backbone.trainable_module().parameters()), OnDevice)
    assert state.last_metrics["step"] == 2 and torch.isfinite(torch.tensor(state.last_metrics["loss"]))


def waits_per_update(config: ResolvedConfig) -> list[Counter]:
    """What each of two steps' updates would make the host wait for on a CUDA device, by op."""
    trainer = Trainer(config, PluginManager(), accelerator=FakeDeviceAccelerator(cpu=True))
    waits = []
    with FakeDevice() as device:
        trainer.setup()
        for step in range(2):
            state = trainer.state
            sampled = rollout.collect(state, step)
            gyremedia_score_rollout(state, sampled, start_scoring(state, sampled), step)
            gyremedia_compute_advantages(state, sampled, step)
            device.syncs.clear()
            gyremedia_update(state, sampled, step)
            waits.append(Counter(device.syncs))
    return waits


TREE_GRPO = (
    "tree_grpo, aggregate: logprob, normalize_depth: true, dedup: true, width: 1, skip_zero_advantage: true",
    "rollout.branch_steps=[0, 1]",
    "rollout.group_size=4",
)


@pytest.mark.parametrize(
    "objective,few,many,overrides",
    [
        ("grpo", "timestep_fraction: 0.5", "timestep_fraction: 1.0", ()),
        ("grpo", "timestep_fraction: 0.5", "timestep_fraction: 1.0", ("train.reuse_rollout_forward=true",)),
        ("nft", "timesteps: 1", "timesteps: 4", ()),
        ("pairwise", "timesteps: 1", "timesteps: 4", ()),
        (TREE_GRPO[0], "timestep_fraction: 0.5", "timestep_fraction: 1.0", TREE_GRPO[1:]),
    ],
    ids=["grpo", "grpo+reuse", "nft", "pairwise", "tree_grpo"],
)
def test_an_update_waits_for_the_accelerator_a_fixed_number_of_times_however_many_micro_steps(
    make_config, objective, few, many, overrides
):
    """A value read back (float(), .item(), bool()), a copy between host and device, or an output sized by the
    data makes the host wait until the accelerator has run all that is queued, so it cannot queue the next
    kernels meanwhile. The loss terms and the gradient norm are read once per optimizer step, together, the
    forward-process objectives copy all their micro-steps' noise at once, and tree GRPO plans every micro-step's
    rows and nodes on the host at once: more micro-steps add no wait."""
    sampler = "flow_sde" if "grpo" in objective else "ode"  # the forward-process objectives re-noise any sample

    def waits(settings: str) -> list[Counter]:
        return waits_per_update(
            make_config(
                f"objective={{name: {objective}, {settings}}}",
                f"sampler.name={sampler}",
                "rollout.num_steps=4",
                *overrides,
            )
        )

    few_waits, many_waits = waits(few), waits(many)
    assert few_waits == many_waits and sum(many_waits[0].values()) <= 6, (few_waits, many_waits)


def test_host_and_device_copies_are_exact_and_made_at_once():
    with FakeDevice() as device:
        floats = torch.tensor([0.1, -2.5e-30, float("nan")]).to(DEVICE)
        ints = torch.tensor([[3, 2**52 + 1], [-7, 0]]).to(DEVICE)
        flags = torch.tensor([True, False]).to(DEVICE)
        device.syncs.clear()
        host = to_host(floats, None, ints, flags, torch.arange(2))
        assert sum(device.syncs.values()) == 1  # one read for all three
        assert [t.dtype for t in host if t is not None] == [torch.float32, torch.int64, torch.bool, torch.int64]
        assert host[1] is None and not any(isinstance(t, OnDevice) for t in host if t is not None)
        assert torch.equal(host[0][:2], floats.cpu()[:2]) and host[0][2].isnan()
        assert torch.equal(host[2], ints.cpu()) and torch.equal(host[3], flags.cpu())
        device.syncs.clear()
        there = to_device([torch.arange(3), torch.ones(2), torch.tensor([5, 6])], DEVICE)
        assert sum(device.syncs.values()) == 2  # one copy per dtype
        assert all(isinstance(t, OnDevice) for t in there)
        assert there[0].tolist() == [0, 1, 2] and there[1].tolist() == [1.0, 1.0] and there[2].tolist() == [5, 6]


def test_the_world_model_trains_on_an_accelerator(tmp_path, plugin_manager):
    from plugins.test_world import world_config

    config = world_config(
        tmp_path,
        "objective={name: nft, kl_beta: 0.1}",
        "sampler.name=ode",
        "rewards=[inverse_dynamics, world_fidelity]",
        "advantage.combine=normalize_each",
    )
    with FakeDevice():
        state = Trainer(config, plugin_manager, accelerator=FakeDeviceAccelerator(cpu=True)).train()
    assert state.last_metrics["step"] == 2
