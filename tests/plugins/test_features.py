"""The features are plugins: each can be left out (GYREMEDIA_PLUGINS) without changing a run that does not use
it, and a config that sets its keys while it is out is refused before any model loads, naming the plugin."""

from __future__ import annotations

import importlib.metadata
import math

import pytest

from gyremedia.config import ConfigError
from gyremedia.plugins import ALLOW_LIST_ENV, ENTRY_POINT_GROUP, PluginManager
from gyremedia.trainer import Trainer

FEATURES = {
    "candidates": "rollout.candidates=8",
    "pareto": "pareto.enabled=true",
    "prompt_history": "advantage.history=4",
    "forward_reuse": "train.reuse_rollout_forward=true",
    "monitor": "monitor.drift=true",
}


def without(feature: str) -> str:
    return ",".join(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name != feature)


@pytest.mark.parametrize("feature", FEATURES)
def test_a_run_trains_without_a_feature_it_does_not_use(feature, make_config, monkeypatch):
    monkeypatch.setenv(ALLOW_LIST_ENV, without(feature))
    pm = PluginManager()
    assert not pm.pm.has_plugin(feature) and pm.pm.has_plugin("gyremedia.stages")
    state = Trainer(make_config("train.steps=1", plugins=pm), pm).train()
    assert state.step == 1 and math.isfinite(state.last_metrics["loss"])
    assert ("monitor/collapse" in state.last_metrics) == (feature != "monitor")  # the monitor reports every eval
    with pytest.raises(
        ConfigError, match=f"{FEATURES[feature].split('=')[0]} is read by the plugin '{feature}', which is not loaded"
    ):
        make_config(FEATURES[feature], plugins=pm)


def test_gold_rewards_without_the_monitor_are_refused(make_config, monkeypatch):
    monkeypatch.setenv(ALLOW_LIST_ENV, without("monitor"))
    with pytest.raises(ConfigError, match="monitor.gold is scored by the plugin 'monitor', which is not loaded"):
        make_config("monitor.gold=[shapes_verifier]", plugins=PluginManager())
