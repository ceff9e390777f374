"""Shared fixtures: a tiny run config that trains in seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager

TINY_YAML = """
run: {output_dir: RUN_DIR, seed: 0}
backbone:
  name: flow_matching
  max_sequence_length: 1
  tiny: {latent_size: 4, vae_channels: [8, 8], num_layers: 1, attention_head_dim: 8, text_hidden_size: 16, text_layers: 1}
sampler: {name: flow_sde}
objective: {name: grpo, clip_range: 0.01}
rewards: [{name: jpeg_compressibility}]
data: {prompts: [a red circle, a blue square, two green triangles]}
rollout: {batch_size: 8, group_size: 4, num_steps: 3}
train: {steps: 2, learning_rate: 0.001}
checkpoint: {every: 1}
eval: {samples: 6, grid_size: 6}
export: {on_train_end: false}
logging: {loggers: [jsonl], progress: false}
"""


@pytest.fixture(scope="session")
def plugin_manager() -> PluginManager:
    return PluginManager()


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    """A tiny run's yaml file whose run folder is inside ``tmp_path``."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML.replace("RUN_DIR", str(tmp_path / "run")))
    return path


@pytest.fixture
def make_config(tiny_yaml: Path, plugin_manager: PluginManager):
    """Resolve the tiny config with ``key=value`` overrides."""

    def make(*overrides: str, plugins: PluginManager | None = None):
        return resolve_config(load_config(tiny_yaml, list(overrides)), plugins or plugin_manager)

    return make


def read_yaml(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path))
