"""Rollouts and replay: every stochastic sampler's replayed log-probs equal the rollout's."""

from __future__ import annotations

import pytest
import torch

from gyremedia.interfaces import BuildContext, ObjectiveContext
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Rollout
from gyremedia.sampling import KeptForwards, replay_transition, sample_generators, sample_trajectories, stochastic_steps
from gyremedia_samplers.cps import CPSOptions, CPSSampler
from gyremedia_samplers.ddim import DDIMEtaOptions, DDIMEtaSampler
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.window import WindowOptions, WindowSampler


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampler_name", ["flow_sde", "cps", "dance_sde"])
def test_replayed_log_probs_equal_rollout_log_probs(make_config, sampler_name, dtype):
    """fp32 to 1e-5, and in bf16 too: the states and the model run in bf16, the log-probs in fp32 (the replay
    of the same batch reproduces the rollout's numbers, so they agree to the last bit)."""
    config = make_config(f"sampler={{name: {sampler_name}}}", f"backbone.dtype={dtype}")
    pm = PluginManager()
    context = BuildContext(device=torch.device("cpu"))
    backbone = pm.component("backbone", "flow_matching").build(config.backbone.options, context)
    sampler = pm.component("sampler", sampler_name).build(config.sampler.options, context)
    prompts = ["a red circle", "a blue square", "a red circle"]
    conditions = backbone.encode(prompts)
    states, log_probs, sigmas = sample_trajectories(
        backbone,
        sampler,
        conditions,
        initial_generators=sample_generators(0, 0, 0, [0, 1, 2]),
        step_generators=sample_generators(0, 0, 1, [0, 1, 2]),
        num_steps=4,
        guidance_scale=1.0,
    )
    assert states.shape[:2] == (3, 5) and log_probs.shape == (3, 4)
    rollout = Rollout(
        prompts=prompts,
        sample_ids=torch.arange(3),
        group_ids=torch.zeros(3, dtype=torch.long),
        conditions=conditions,
        states=states,
        log_probs=log_probs,
        sigmas=sigmas,
    )
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    for i in range(4):
        transition, _ = replay_transition(ctx, rollout, i)
        assert transition.log_prob.dtype == torch.float32
        # a deterministic step (cps's last) has no density in either: NaN in both
        torch.testing.assert_close(
            transition.log_prob, log_probs[:, i], rtol=0, atol=1e-5 if dtype == "float32" else 0, equal_nan=True
        )


def test_kept_forwards_give_each_output_once_for_the_rows_and_states_asked():
    trajectories = torch.arange(16.0).reshape(4, 4, 1)  # samples 4-7, their states before transitions 0-3
    kept = KeptForwards(torch.tensor([4, 5, 6, 7]), frozenset({0, 1, 3}))
    kept.keep(0, trajectories[:, 0], torch.arange(4.0).requires_grad_())
    kept.keep(1, trajectories[:, 1], torch.arange(4.0))
    kept.keep(3, trajectories[:, 3] + 1, torch.arange(4.0))  # not the states training replays: rewritten since
    ids, replayed = torch.tensor([7, 5]), trajectories[[3, 1]]
    subset = kept.take(0, ids, replayed)
    assert subset.tolist() == [3.0, 1.0] and subset.requires_grad  # rows by sample id, graph kept
    assert kept.take(0, ids, replayed) is None  # once: its backward frees the graph
    assert kept.take(3, ids, replayed) is None  # states rewritten since: replay (compared at the first take)
    assert kept.take(1, torch.tensor([5, 8]), trajectories[[1, 0]]) is None  # a sample it did not keep: replay instead
    assert kept.take(2, torch.tensor([4]), trajectories[:1]) is None
    assert not kept.outputs  # no graph outlives its one take


FLOW_SIGMAS = torch.linspace(1, 0, 5)


@pytest.mark.parametrize(
    "make_sampler,sigmas,expected",
    [
        (lambda: FlowSDESampler(FlowSDEOptions()), FLOW_SIGMAS, [0, 1, 2, 3]),
        (lambda: CPSSampler(CPSOptions()), FLOW_SIGMAS, [0, 1, 2]),
        (lambda: DDIMEtaSampler(DDIMEtaOptions(eta=1.0)), torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0]), [0, 1, 2]),
        (lambda: DDIMEtaSampler(DDIMEtaOptions(eta=1.0)), torch.tensor([0.99, 0.8, 0.5, 0.2, 0.1]), [0, 1, 2, 3]),
        (lambda: DDIMEtaSampler(DDIMEtaOptions(eta=0.0)), torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0]), []),
        (lambda: WindowSampler(WindowOptions(size=2, schedule="fixed")), FLOW_SIGMAS, [0, 1]),
        (lambda: WindowSampler(WindowOptions(sde="cps", size=3, schedule="random")), torch.linspace(1, 0, 7), None),
    ],
    ids=["flow_sde", "cps", "ddim-to-alpha-1", "ddim-not-to-alpha-1", "ddim-eta-0", "window", "window-cps-random"],
)
def test_declared_stochastic_steps_are_those_with_a_log_prob(make_sampler, sigmas, expected):
    """What a sampler says it will sample stochastically, before a rollout, is where its steps have a density:
    the trainer plans the forwards it keeps from it."""
    sampler, x = make_sampler(), torch.randn(2, 3)
    with_density = [
        i
        for i in range(len(sigmas) - 1)
        if torch.isfinite(sampler.step(x, torch.randn(2, 3), sigmas, i, noise=torch.randn(2, 3)).log_prob).all()
    ]
    assert stochastic_steps(sampler, sigmas) == with_density
    assert expected is None or with_density == expected
