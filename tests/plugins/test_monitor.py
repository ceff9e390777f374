"""The reward-hacking monitor: gold rewards and drift at each evaluation, a warning when the proxy
rises while gold falls, a collapse warning when diversity drops."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from gyremedia.config import ConfigError, MonitorSection
from gyremedia.evaluation import EvalResult
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Media
from gyremedia.trainer import Trainer
from gyremedia_features.monitor import HackingMonitor


class Constant:
    kinds = {"image"}

    def __init__(self) -> None:
        self.value = 0.5

    def __call__(self, media, prompts):
        return torch.full((len(prompts),), self.value)


def evaluate(monitor, gold, step, proxy, gold_value, diversity=0.3):
    gold.value = gold_value
    result = EvalResult(["p"] * 2, Media("image", torch.zeros(2, 3, 4, 4)), {})
    metrics = {"eval/proxy": proxy, "eval/diversity": diversity}
    monitor.on_eval(step, result, metrics, backbone=None, guidance_scale=1.0)
    return metrics


def test_warns_when_the_proxy_rises_while_gold_falls(caplog):
    gold = Constant()
    monitor = HackingMonitor(MonitorSection(tolerance=0.01), {"judge": gold}, proxy="eval/proxy")
    with caplog.at_level(logging.WARNING, logger="gyremedia"):
        assert evaluate(monitor, gold, 0, 0.30, 0.50)["monitor/hacking"] == 0.0  # nothing to compare yet
        first = evaluate(monitor, gold, 10, 0.40, 0.55)  # both rise: learning
        assert first["monitor/hacking"] == 0.0 and first["eval/gold/judge"] == pytest.approx(0.55)
        assert evaluate(monitor, gold, 20, 0.41, 0.545)["monitor/hacking"] == 0.0  # within the tolerance
        assert evaluate(monitor, gold, 30, 0.50, 0.40)["monitor/hacking"] == 1.0  # proxy up, gold down
    assert (
        "reward hacking? at step 30 the proxy eval/proxy rose 0.4100 -> 0.5000 while eval/gold/judge fell"
        in caplog.text
    )
    restored = HackingMonitor(MonitorSection(tolerance=0.01), {"judge": gold}, proxy="eval/proxy")
    restored.load_state_dict(monitor.state_dict())
    assert evaluate(restored, gold, 40, 0.60, 0.30)["monitor/hacking"] == 1.0


def test_warns_when_diversity_collapses(caplog):
    monitor = HackingMonitor(MonitorSection(min_diversity=0.5), {}, proxy="eval/proxy")
    with caplog.at_level(logging.WARNING, logger="gyremedia"):
        assert evaluate(monitor, Constant(), 0, 0.3, 0.5, diversity=0.30)["monitor/collapse"] == 0.0
        assert evaluate(monitor, Constant(), 10, 0.3, 0.5, diversity=0.16)["monitor/collapse"] == 0.0
        metrics = evaluate(monitor, Constant(), 20, 0.3, 0.5, diversity=0.14)
    assert metrics["monitor/collapse"] == 1.0 and "monitor/hacking" not in metrics  # no gold: no hacking check
    assert "mode collapse?" in caplog.text


def test_a_run_reports_gold_and_drift(make_config, tmp_path):
    config = make_config(
        "monitor={gold: [{name: shapes_verifier, criteria: [colour]}], drift: true}",
        "train.steps=2",
        "train.learning_rate=0.01",
    )
    Trainer(config, PluginManager()).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/gold/shapes_verifier" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert evals[0]["eval/drift"] == 0.0 and evals[1]["eval/drift"] > 0  # the policy left the reference
    assert "eval/gold/shapes_verifier/position" in evals[0] and "monitor/hacking" in evals[1]


def test_gold_rewards_are_validated(make_config):
    with pytest.raises(ConfigError, match="monitor.gold.0.name.*unknown reward 'judg'"):
        make_config("monitor={gold: [judg]}")
    with pytest.raises(ConfigError, match="selects reward 'jpeg_compressibility' twice"):
        make_config("monitor={gold: [jpeg_compressibility, jpeg_compressibility]}")
