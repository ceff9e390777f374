"""Config validation: every bad config fails before any model loads, naming the key and the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from gyremedia import hookimpl
from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

# Each bad input's exact message is in docs/errors.md, which tests/test_errors.py runs row by row.


def test_missing_component_section(tmp_path, plugin_manager):
    from gyremedia.config import load_config, resolve_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {prompts: [x]}\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(load_config(path), plugin_manager)
    for section in ("backbone", "objective", "rewards"):
        assert f"missing value for '{section}'" in str(info.value)
    path.write_text("data: {prompts: [x]}\nbackbone: flow_matching\nobjective: nft\nrewards: [jpeg_compressibility]\n")
    with pytest.raises(
        ConfigError,
        match="missing value for 'sampler': backbone 'flow_matching' takes its denoising "
        "steps from a sampler: choose one of cps, dance_sde",
    ):
        resolve_config(load_config(path), plugin_manager)


def test_every_error_is_reported_at_once(make_config):
    with pytest.raises(ConfigError) as info:
        make_config("sampler.name=nope", "rewards.0.name=nope", "rollout.batch_size=10")
    message = str(info.value)
    assert "unknown sampler" in message and "unknown reward" in message and "not divisible" in message


def test_resolved_config_fills_plugin_defaults(make_config):
    config = make_config("sampler.noise_level=0.5", "eval.sampler=ode")
    assert config.sampler.options.noise_level == 0.5
    assert config.eval_sampler.name == "ode"
    text = config.to_yaml()
    assert "noise_level: 0.5" in text and "adv_clip_max: 5.0" in text and "quality: 95" in text
    assert "sampler:\n    name: ode" in text


def test_asset_paths_resolve_into_the_assets_folder(make_config):
    from gyremedia.config import asset_path

    config = make_config("data.prompts_file=${asset:shapes16/train_prompts.txt}")
    assert config.core.data.prompts_file == asset_path("shapes16/train_prompts.txt")
    assert config.core.data.prompts_file.endswith("assets/shapes16/train_prompts.txt")


class FourProcesses:
    num_processes = 4


def test_batch_not_divisible_by_processes_fails_before_models_load(make_config):
    with pytest.raises(ConfigError, match="not divisible by the 4 processes"):
        Trainer(make_config("rollout.batch_size=6", "rollout.group_size=3"), None, accelerator=FourProcesses())
    with pytest.raises(ConfigError, match="train.num_minibatches=4"):
        Trainer(
            make_config("rollout.batch_size=12", "rollout.group_size=3", "train.num_minibatches=4"),
            None,
            accelerator=FourProcesses(),
        )


def test_existing_run_folder_is_not_overwritten(make_config, tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-000001" / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(make_config(), None)


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.lerning_rate=1", "train.lerning_rate"),
        ("sampler.name=flow_sdee", "flow_sdee"),
        ("rollout.batch_size=7", "rollout.batch_size"),
        ("train.learning_rate=-1", "train.learning_rate=-1.0: must be > 0"),
    ],
)
def test_cli_rejects_bad_config_in_seconds_without_loading_a_model(tiny_yaml, tmp_path, override, key):
    """The CLI exits 2, names the key, creates no run folder; importing diffusers is not needed."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    probe = (
        "import sys; from gyremedia.cli import main; code = main(sys.argv[1:]); "
        "loaded = [m for m in ('diffusers', 'transformers') if m in sys.modules]; "
        "print('LOADED', loaded, file=sys.stderr); sys.exit(code)"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", probe, "train", str(tiny_yaml), override],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert key in result.stderr
    assert "LOADED []" in result.stderr
    assert not (tmp_path / "run").exists()
    assert elapsed < 30


def test_compile_needs_a_backbone_that_compiles_its_networks(make_config):
    class PlainBackbones:
        @hookimpl
        def gyremedia_register_backbones(self, register):
            register("plain", lambda context: None)  # a third party's policy without compile()

    plugins = PluginManager(extra_plugins=[PlainBackbones()])
    make_config("train.compile=true", plugins=plugins)  # the first-party backbones compile
    with pytest.raises(ConfigError, match=re.escape("train.compile: backbone 'plain' does not compile its networks")):
        make_config("backbone={name: plain}", "train.compile=true", plugins=plugins)
    make_config("backbone={name: plain}", plugins=plugins)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["objective={name: nft}", "sampler.name=ode"], "objective 'nft' does not name the transitions it replays"),
        (["rollout.async_scoring=true"], "set rollout.async_scoring=false"),
        (["objective={name: tree_grpo}", "rollout.branch_steps=[0, 1]"], "set rollout.branch_steps=[]"),
    ],
)
def test_reused_rollout_forwards_need_an_on_policy_flat_rollout_and_a_planning_objective(
    make_config, overrides, message
):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_config("train.reuse_rollout_forward=true", *overrides)
    make_config(*overrides)  # the same settings without it are fine


def test_a_label_selects_one_reward_twice(make_config):
    with pytest.raises(ConfigError, match="reward 'jpeg_compressibility' is selected twice: .* its own label"):
        make_config("rewards=[jpeg_compressibility, jpeg_compressibility]")
    config = make_config(
        "rewards=[{name: jpeg_compressibility, label: small}, {name: jpeg_compressibility, label: big, quality: 50}]",
        "eval.metric=big",
    )
    assert [(s.name, s.component) for s in config.rewards] == [
        ("small", "jpeg_compressibility"),
        ("big", "jpeg_compressibility"),
    ]
    assert config.rewards[1].as_dict()["name"] == "jpeg_compressibility"  # the saved config selects the plugin
    with pytest.raises(ConfigError, match=r"rewards.0.label='a/b': give a name without '/'"):
        make_config("rewards=[{name: jpeg_compressibility, label: a/b}]")
