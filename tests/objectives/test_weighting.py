"""Timestep weightings: the fixed profiles' formulas, the budgeted choice, the dynamic schedule, and
the ``weighting:`` section's defaults and errors."""

from __future__ import annotations

import json

import pytest
import torch

from gyremedia import hookimpl
from gyremedia.cli import main
from gyremedia.config import ConfigError
from gyremedia.objectives.weighting import (
    PROFILES,
    Budgeted,
    BudgetedOptions,
    Dynamic,
    DynamicOptions,
    GeneralisedHuber,
    GHuberOptions,
    power_weight,
)
from gyremedia.options import validate
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


def test_fixed_profiles():
    error, t = torch.tensor([4.0, 1.0]), torch.tensor([0.5, 0.25])
    torch.testing.assert_close(PROFILES["uniform"](error, t), -error)
    torch.testing.assert_close(PROFILES["t"](error, t), -t * error)
    torch.testing.assert_close(PROFILES["t2"](error, t), -(t**2) * error)
    torch.testing.assert_close(GeneralisedHuber(GHuberOptions(power=0.5))(error, t), -t * error.sqrt() / 0.5)
    assert validate(GHuberOptions(power=0.0), "weighting.")[0].startswith("weighting.power=0.0: must be in (0, 1]")


def test_power_weight_moves_emphasis_not_scale():
    t = torch.linspace(0, 1, 100_001)
    for power in (0.0, 1.0, 2.0, 3.5):
        assert power_weight(t, power).mean().item() == pytest.approx(1.0, rel=1e-3)
    assert power_weight(torch.tensor(0.9), 2.0) > power_weight(torch.tensor(0.9), 0.0)  # high noise weighs more


def step_end(weighting, **metrics):
    weighting.gyremedia_on_step_end(state=None, metrics=metrics)
    return metrics


def test_budgeted_explores_round_robin_then_keeps_the_profile_that_raised_the_reward():
    weighting = Budgeted(BudgetedOptions(profiles=["uniform", "t", "t2"], budget_steps=6), None)
    error, t = torch.tensor([1.0]), torch.tensor([0.5])
    reward, used = 0.0, []
    gains = {"uniform": 0.0, "t": 0.1, "t2": -0.05}  # what a step trained with each profile adds
    for _ in range(9):
        profile = weighting.profiles[weighting.current()]
        used.append(profile)
        torch.testing.assert_close(weighting(error, t), PROFILES[profile](error, t))
        step_end(weighting, reward=reward)
        reward += gains[profile]
    assert used[:6] == ["uniform", "t", "t2"] * 2
    assert used[6:] == ["t"] * 3 and weighting.chosen == 1
    means = weighting.mean_credits()
    assert means[1] == pytest.approx(0.1) and means[2] == pytest.approx(-0.05)

    restored = Budgeted(BudgetedOptions(profiles=["uniform", "t", "t2"], budget_steps=6), None)
    restored.load_state_dict(weighting.state_dict())
    assert restored.current() == 1 and restored.mean_credits() == means


def test_budgeted_refuses_a_budget_too_small_or_an_unknown_profile():
    assert "at least 2 steps" in validate(BudgetedOptions(profiles=["uniform", "t"], budget_steps=3))[0]
    assert "give at least two of uniform, t, t2, ghuber" in validate(BudgetedOptions(profiles=["uniform", "cosine"]))[0]


def test_dynamic_moves_from_early_to_late_power_as_the_gap_closes():
    weighting = Dynamic(DynamicOptions(early_power=2.0, late_power=0.0, smoothing=0.0), None)
    assert weighting.power == 2.0  # before any measurement
    assert step_end(weighting, reward_group_std=0.2)["weighting/power"] == 2.0
    assert step_end(weighting, reward_group_std=0.1)["weighting/power"] == pytest.approx(1.0)
    assert step_end(weighting, reward_group_std=0.0)["weighting/power"] == 0.0
    assert step_end(weighting, reward_group_std=0.4)["weighting/power"] == 2.0  # capped at early_power
    assert "weighting/power" not in step_end(weighting, reward_group_std=float("nan"))
    error, t = torch.tensor([2.0]), torch.tensor([0.5])
    torch.testing.assert_close(weighting(error, t), -power_weight(t, 2.0) * error)


def test_the_objectives_default_and_the_section_overrides_it(make_config):
    assert make_config("objective={name: awm}", "sampler={name: ode}").weighting.name == "t"
    assert make_config("objective={name: vgrpo}", "sampler={name: ode}").weighting.name == "uniform"
    assert make_config("objective={name: grpo}").weighting is None
    config = make_config("objective={name: awm}", "sampler={name: ode}", "weighting={name: ghuber, power: 0.5}")
    assert config.weighting.options.power == 0.5
    assert "weighting:\n  name: ghuber\n  power: 0.5" in config.to_yaml()


def test_weighting_errors_name_the_fix(make_config):
    with pytest.raises(ConfigError, match="objective 'grpo' has no timestep weighting.*awm"):
        make_config("weighting=t")
    with pytest.raises(ConfigError, match="Did you mean 'dynamic'"):
        make_config("objective={name: awm}", "sampler={name: ode}", "weighting=dynamc")
    with pytest.raises(ConfigError, match="weighting.budget"):
        make_config("objective={name: awm}", "sampler={name: ode}", "weighting={name: budgeted, budget: 3}")


def test_an_adaptive_weighting_trains_logs_and_resumes(tiny_yaml, tmp_path):
    common = [
        "objective={name: awm}",
        "sampler={name: ode}",
        "checkpoint.every=2",
        "weighting={name: budgeted, profiles: [uniform, t2], budget_steps: 4}",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", str(tiny_yaml), f"run.output_dir={straight}", "train.steps=3", *common]) == 0
    assert main(["train", str(tiny_yaml), f"run.output_dir={split}", "train.steps=2", *common]) == 0
    assert main(["train", "--resume", str(split), "train.steps=3"]) == 0

    def rows(run):
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]

    assert [r["weighting/profile"] for r in rows(straight) if "weighting/profile" in r] == [0.0, 1.0, 0.0]
    assert rows(split)[-1] == rows(straight)[-1]


def test_dynamic_weighting_logs_its_power(make_config):
    config = make_config("objective={name: awm}", "sampler={name: ode}", "weighting=dynamic", "train.steps=2")
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert 0.0 <= metrics["weighting/power"] <= 2.0 and metrics["weighting/gap"] > 0


class CosineWeighting:
    """A third party's weighting: registered through the hook, selected by the yaml like ours."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, error, t):
        self.calls += 1
        return -torch.cos(t * torch.pi / 2) * error


class ThirdPartyPlugin:
    made: list[CosineWeighting] = []

    @staticmethod
    @hookimpl
    def gyremedia_register_weightings(register):
        register("cosine", lambda context: ThirdPartyPlugin.made.append(CosineWeighting()) or ThirdPartyPlugin.made[-1])


def test_a_registered_weighting_is_selected_by_name(make_config):
    pm = PluginManager(extra_plugins=[ThirdPartyPlugin])
    config = make_config(
        "objective={name: vgrpo}", "sampler={name: ode}", "weighting=cosine", "train.steps=1", plugins=pm
    )
    Trainer(config, pm).train()
    assert ThirdPartyPlugin.made[-1].calls > 0
