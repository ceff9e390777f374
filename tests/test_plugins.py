"""Plugin discovery through entry points, registration, and the safety rules around them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from gyremedia import hookimpl
from gyremedia.plugins import ALLOW_LIST_ENV, PluginError, PluginManager

FIRST_PARTY = {
    "flow_matching",
    "grpo",
    "tree_grpo",
    "nft",
    "awm",
    "pairwise",
    "weightings",
    "samplers",
    "rewards",
    "loggers",
    "regularizers",
}


def make_distribution(root, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Write an installed-looking distribution (dist-info with entry points) plus its modules."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[gyremedia]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


def test_first_party_plugins_are_discovered_through_entry_points():
    result = subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", "plugins", "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    by_name = {row["plugin"]: row for row in listing["plugins"]}
    assert FIRST_PARTY <= set(by_name)
    assert all(by_name[name]["package"] == "gyremedia" for name in FIRST_PARTY)
    assert "sampler:flow_sde" in by_name["samplers"]["registers"]
    assert "objective:grpo" in by_name["grpo"]["registers"]
    assert "backbone:flow_matching" in by_name["flow_matching"]["registers"]
    field = {"pickscore", "hpsv2", "aesthetic", "clap", "geneval", "remote", "image_reward", "hpsv3", "videoalign"}
    assert {f"reward:{name}" for name in field} <= set(by_name["rewards"]["registers"])  # the field's rewards
    seeds = ("spatial_grpo", "crd", "dohf", "gdro", "gipo", "grpo_guard", "vgrpo")  # the seed papers' objectives
    registered = {r for row in listing["plugins"] for r in row["registers"]}
    assert {f"objective:{name}" for name in seeds} <= registered


def test_plugins_command_prints_a_table():
    result = subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", "plugins"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "flow_sde" in result.stdout and "(package gyremedia)" in result.stdout


def test_broken_plugin_is_reported_by_package_and_does_not_break_other_runs(tmp_path, monkeypatch):
    make_distribution(
        tmp_path,
        "broken_rewards_pkg",
        {"broken": "broken_rewards_mod"},
        {"broken_rewards_mod": "import a_module_that_does_not_exist\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager()
    assert [(f.name, f.distribution) for f in pm.failed] == [("broken", "broken_rewards_pkg")]
    assert "a_module_that_does_not_exist" in pm.failed[0].error
    assert pm.component("sampler", "flow_sde").plugin == "samplers"  # unrelated components still work
    with pytest.raises(PluginError, match="broken_rewards_pkg"):
        pm.component("reward", "fancy_reward")


def test_third_party_plugin_registers_like_first_party(tmp_path, monkeypatch):
    make_distribution(
        tmp_path,
        "my_rewards",
        {"mine": "my_rewards_mod"},
        {
            "my_rewards_mod": """
        from dataclasses import dataclass
        from gyremedia import hookimpl

        @dataclass
        class Options:
            scale: float = 1.0

        class Brightness:
            kinds = {"image"}
            def __init__(self, options, context):
                self.scale = options.scale
            def __call__(self, media, prompts):
                return self.scale * media.data.mean(dim=(1, 2, 3))

        @hookimpl
        def gyremedia_register_rewards(register):
            register("brightness", Brightness, options=Options, kinds={"image"})
    """
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = PluginManager()
    component = pm.component("reward", "brightness")
    assert component.plugin == "mine"
    assert pm.distributions["mine"] == "my_rewards"


def test_allow_list_restricts_which_plugins_load(monkeypatch):
    monkeypatch.setenv(ALLOW_LIST_ENV, "samplers,grpo")
    pm = PluginManager()
    assert pm.registry.names("sampler") == ["cps", "dance_sde", "ddim_eta", "flow_sde", "heun", "ode", "window"]
    assert pm.registry.names("objective") == ["grpo"]
    assert pm.registry.names("reward") == []


class DataChangingModule:
    @staticmethod
    @hookimpl
    def gyremedia_process_rewards(state, rollout, rewards):
        rewards.clear()


def test_module_level_data_changing_hook_is_refused():
    with pytest.raises(PluginError, match="gyremedia_process_rewards at module level"):
        PluginManager(extra_plugins=[DataChangingModule], load_entry_points=False)


def test_duplicate_component_names_are_an_error():
    class Twice:
        @staticmethod
        @hookimpl
        def gyremedia_register_samplers(register):
            register("flow_sde", object)

    with pytest.raises(PluginError, match="registered twice"):
        PluginManager(extra_plugins=[Twice])


def test_options_must_be_a_dataclass():
    class BadOptions:
        @staticmethod
        @hookimpl
        def gyremedia_register_rewards(register):
            register("r", object, options=dict)

    with pytest.raises(PluginError, match="options must be a dataclass"):
        PluginManager(extra_plugins=[BadOptions], load_entry_points=False)


@dataclass
class _Opts:
    x: int = 1


def test_describe_lists_registrations_and_lifecycle_hooks():
    class Observer:
        @staticmethod
        @hookimpl
        def gyremedia_register_regularizers(register):
            register("noop", lambda options, context: None, options=_Opts)

        @staticmethod
        @hookimpl
        def gyremedia_on_step_end(state, metrics):
            pass

    pm = PluginManager(extra_plugins=[Observer], load_entry_points=False)
    (row,) = [r for r in pm.describe() if r["plugin"] == "Observer"]
    assert row["registers"] == ["regularizer:noop"]
    assert row["hooks"] == ["gyremedia_on_step_end"]


@pytest.mark.parametrize(
    "kind,hook_name",
    [
        ("backbone", "gyremedia_register_backbones"),
        ("sampler", "gyremedia_register_samplers"),
        ("objective", "gyremedia_register_objectives"),
        ("reward", "gyremedia_register_rewards"),
        ("regularizer", "gyremedia_register_regularizers"),
        ("logger", "gyremedia_register_loggers"),
    ],
)
def test_each_registration_hook_registers_its_kind(kind, hook_name):
    def register_one(register):
        register(f"my_{kind}", lambda options, context: (kind, options.x), options=_Opts, description="hi")

    plugin = type("OnePlugin", (), {hook_name: staticmethod(hookimpl(register_one))})
    pm = PluginManager(extra_plugins=[plugin], load_entry_points=False)
    component = pm.component(kind, f"my_{kind}")
    assert component.plugin == "OnePlugin" and component.meta["description"] == "hi"
    assert component.build(_Opts(x=3), context=None) == (kind, 3)


class _DeclaringSampler:
    has_log_prob = True
    prediction = "velocity"


def _plugin_registering(**meta):
    def register_one(register):
        register("declared", _DeclaringSampler, **meta)

    return type("Declaring", (), {"gyremedia_register_samplers": staticmethod(hookimpl(register_one))})


def test_capabilities_are_read_from_the_class_and_unknown_register_keys_are_refused():
    pm = PluginManager(extra_plugins=[_plugin_registering()], load_entry_points=False)
    meta = pm.component("sampler", "declared").meta
    assert meta["has_log_prob"] is True and meta["prediction"] == "velocity" and meta["needs_predict"] is False
    with pytest.raises(PluginError, match="unknown register\\(\\) keys has_logprob \\(did you mean has_log_prob\\?\\)"):
        PluginManager(extra_plugins=[_plugin_registering(has_logprob=False)], load_entry_points=False)
    with pytest.raises(PluginError, match="disagrees with the class's has_log_prob = True: declare it once"):
        PluginManager(extra_plugins=[_plugin_registering(has_log_prob=False)], load_entry_points=False)
