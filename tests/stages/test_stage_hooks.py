"""The loop is its stage hooks: the order one run calls them in, a stage a plugin takes over, and a feature's
config check reported with the config's own errors."""

from __future__ import annotations

import pytest

from gyremedia import hookimpl
from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer


class StageObserver:
    """Records every stage and feature hook as it runs, deferring to the defaults (returns None)."""

    def __init__(self, evaluation: dict[str, float] | None = None) -> None:
        self.calls: list[str] = []
        self.evaluation = evaluation  # given: take the evaluation stage over with these metrics

    @hookimpl(tryfirst=True)
    def gyremedia_prepare_request(self, state, request):
        self.calls.append("prepare_request")

    @hookimpl(tryfirst=True)
    def gyremedia_collect_rollout(self, state, request):
        self.calls.append("collect_rollout")

    @hookimpl(tryfirst=True)
    def gyremedia_score_rollout(self, state, rollout, futures, step):
        self.calls.append("score_rollout")

    @hookimpl(tryfirst=True)
    def gyremedia_compute_advantages(self, state, rollout, step):
        self.calls.append("compute_advantages")

    @hookimpl(tryfirst=True)
    def gyremedia_group_statistics(self, state, step):
        self.calls.append("group_statistics")

    @hookimpl(tryfirst=True)
    def gyremedia_update(self, state, rollout, step):
        self.calls.append("update")

    @hookimpl(tryfirst=True)
    def gyremedia_evaluate(self, state, step):
        self.calls.append(f"evaluate:{step}")
        return self.evaluation

    @hookimpl(tryfirst=True)
    def gyremedia_eval_preference(self, config):
        self.calls.append("eval_preference")

    @hookimpl
    def gyremedia_after_eval(self, state, step, result, metrics):
        self.calls.append("after_eval")

    @hookimpl(tryfirst=True)
    def gyremedia_save_checkpoint(self, state):
        self.calls.append("save_checkpoint")

    @hookimpl(tryfirst=True)
    def gyremedia_finish(self, state):
        self.calls.append("finish")


def observed(observer: StageObserver) -> PluginManager:
    """A plugin manager whose feature plugin registers ``observer`` for each run, as a feature does."""

    class Feature:
        @staticmethod
        @hookimpl
        def gyremedia_setup(state, context):
            state.plugins.register_for_run(observer, name="observer:run")

        @staticmethod
        @hookimpl
        def gyremedia_check_config(core, selected):
            return ["train.steps=7: the observer refuses seven steps"] if core.train.steps == 7 else []

    return PluginManager(extra_plugins=[Feature])


def test_one_run_calls_the_stages_in_order(make_config):
    observer = StageObserver()
    pm = observed(observer)
    Trainer(make_config("train.steps=1", "checkpoint.every=1", plugins=pm), pm).train()
    evaluation = ["evaluate:{}", "eval_preference", "after_eval"]
    assert observer.calls == [
        *(e.format(0) for e in evaluation),
        "prepare_request",
        "collect_rollout",
        "score_rollout",
        "compute_advantages",
        "group_statistics",
        "update",
        *(e.format(1) for e in evaluation),
        "save_checkpoint",
        "finish",
    ]


def test_a_plugin_takes_a_stage_over(make_config, tmp_path):
    observer = StageObserver(evaluation={"eval/custom": 0.5})
    pm = observed(observer)
    state = Trainer(make_config("train.steps=1", plugins=pm), pm).train()
    assert state.last_metrics["eval/custom"] == 0.5 and "eval/diversity" not in state.last_metrics
    assert "after_eval" not in observer.calls and not (tmp_path / "run" / "samples").exists()  # the default's work
    assert "update" in observer.calls and "lr" in state.last_metrics  # the other stages ran their defaults


def test_a_features_config_check_reports_with_the_rest(make_config):
    pm = observed(StageObserver())
    with pytest.raises(ConfigError, match="2 problems in the config") as info:
        make_config("train.steps=7", "rollout.batch_size=6", plugins=pm)
    assert "the observer refuses seven steps" in str(info.value) and "rollout.batch_size=6" in str(info.value)
