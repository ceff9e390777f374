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
    "grpo+flow_sde+gaussian_kl": ["objective={name: grpo, clip_range: 0.01, kl_beta: 0.1, timestep_fraction: 0.7}",
                                  "regularizers=[velocity_norm_hinge]"],
    "nft+ode+velocity_kl": ["objective={name: nft, kl_beta: 0.1}", "sampler={name: ode}"],
    "awm+heun+ghuber": ["objective={name: awm}", "sampler={name: heun}", "weighting={name: ghuber}"],
    "vgrpo+dance_sde": ["objective={name: vgrpo}", "sampler={name: dance_sde}"],
    "pairwise+cps+dynamic": ["objective={name: pairwise}", "sampler={name: cps}", "weighting={name: dynamic}"],
    "window": ["sampler={name: window, size: 2, schedule: random}"],
    "encoders-on-cpu": ["backbone.text_encoders_on_cpu=true", "backbone.vae_slicing=true"],
    "tree_grpo": ["objective={name: tree_grpo, clip_range: 0.01, aggregate: logprob, normalize_depth: true, "
                  "dedup: true, width: 1}", "rollout.branch_steps=[0, 1]"],
    "pareto+monitor+async": ["rewards=[jpeg_compressibility, {name: jpeg_compressibility_2, on_failure: drop}]",
                             "pareto.enabled=true", "backbone.preference_inputs=2", "advantage.combine=normalize_each",
                             "monitor={drift: true, gold: [jpeg_compressibility]}", "rollout.async_scoring=true",
                             "train.num_minibatches=2"],
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
            rollout = trainer.collect_rollout(step)
            trainer.score(rollout, step)
            trainer.compute_advantages(rollout, step)
            device.syncs.clear()
            trainer.optimize(rollout, step)
            waits.append(Counter(device.syncs))
    return waits


@pytest.mark.parametrize("few,many", [
    ("{name: grpo, timestep_fraction: 0.5}", "{name: grpo, timestep_fraction: 1.0}"),
    ("{name: nft, timesteps: 1}", "{name: nft, timesteps: 4}"),
    ("{name: pairwise, timesteps: 1}", "{name: pairwise, timesteps: 4}")], ids=["grpo", "nft", "pairwise"])
def test_an_update_waits_for_the_accelerator_a_fixed_number_of_times_however_many_micro_steps(make_config, few, many):
    """A value read back (float(), .item(), bool()), a copy between host and device, or an output sized by the
    data makes the host wait until the accelerator has run all that is queued, so it cannot queue the next
    kernels meanwhile. The loss terms and the gradient norm are read once per optimizer step, together, and the
    forward-process objectives copy all their micro-steps' noise at once: more micro-steps add no wait."""
    sampler = "flow_sde" if "grpo" in few else "ode"  # the forward-process objectives re-noise any sample
    few_waits = waits_per_update(make_config(f"objective={few}", f"sampler.name={sampler}", "rollout.num_steps=4"))
    many_waits = waits_per_update(make_config(f"objective={many}", f"sampler.name={sampler}", "rollout.num_steps=4"))
    assert few_waits == many_waits and sum(many_waits[0].values()) <= 6, (few_waits, many_waits)


def test_the_world_model_trains_on_an_accelerator(tmp_path, plugin_manager):
    from plugins.test_world import world_config

    config = world_config(tmp_path, "objective={name: nft, kl_beta: 0.1}", "sampler.name=ode",
                          "rewards=[inverse_dynamics, world_fidelity]", "advantage.combine=normalize_each")
    with FakeDevice():
        state = Trainer(config, plugin_manager, accelerator=FakeDeviceAccelerator(cpu=True)).train()
    assert state.last_metrics["step"] == 2
