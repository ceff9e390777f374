"""Shared fixtures: a tiny run config that trains in seconds on a CPU; the suite's threads and order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager

pytest_plugins = ["suite_budget"]

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


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread for each worker and every process a test starts, unless the test asks for more
    (cli_runs.with_threads): the suite runs on every core at once (pytest-xdist, a worker a core: pyproject.toml),
    and two workers of two spinning OpenMP threads on two cores ran 3x slower than two of one. Set before the workers
    start, so that they and the processes they start inherit it."""
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first: the workers take the long runs while the short tests fill the gaps between them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


LLM_YAML = """
run: {output_dir: RUN_DIR, seed: 0}
backbone: {name: causal_lm, pretrained: MODEL_DIR, max_new_tokens: 4}
objective: {name: token_grpo}
rewards: [{name: format, pattern: '[0-9]', mode: search}]
data: {prompts: ['1+2=', '12+345=', '7+8=']}
rollout: {batch_size: 8, group_size: 4}
train: {steps: 2, learning_rate: 0.01}
checkpoint: {every: 1}
eval: {samples: 6, grid_size: 6}
export: {on_train_end: false}
logging: {loggers: [jsonl], progress: false}
"""


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory) -> Path:
    """A random tiny Qwen2 with the addition task's character tokenizer, saved as a stock folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gyremedia_text.pretrain import build_tokenizer

    folder = tmp_path_factory.mktemp("tiny_lm")
    tokenizer = build_tokenizer(["0123456789+="])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_mdlm(tmp_path_factory) -> Path:
    """A random tiny BERT masked LM with the addition task's character tokenizer and its mask token."""
    from transformers import BertConfig, BertForMaskedLM

    from gyremedia_text.pretrain import build_tokenizer

    folder = tmp_path_factory.mktemp("tiny_mdlm")
    tokenizer = build_tokenizer(["0123456789+="], mask=True)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def make_dllm_config(tmp_path, tiny_mdlm, plugin_manager):
    """The token-policy test config on the tiny masked-diffusion LM (completions of 4 tokens)."""
    path = tmp_path / "dllm.yaml"
    text = LLM_YAML.replace("RUN_DIR", str(tmp_path / "run")).replace("MODEL_DIR", str(tiny_mdlm))
    text = text.replace("name: causal_lm", "name: masked_diffusion_lm")
    path.write_text(text.replace("pattern: '[0-9]'", "pattern: '^[0-9][0-9]'"))  # the random model's vary in this

    def make(*overrides: str, plugins: PluginManager | None = None):
        return resolve_config(load_config(path, list(overrides)), plugins or plugin_manager)

    return make


@pytest.fixture
def llm_yaml(tmp_path, tiny_lm) -> Path:
    path = tmp_path / "llm.yaml"
    path.write_text(LLM_YAML.replace("RUN_DIR", str(tmp_path / "run")).replace("MODEL_DIR", str(tiny_lm)))
    return path


@pytest.fixture
def make_llm_config(llm_yaml, plugin_manager):
    def make(*overrides: str, plugins: PluginManager | None = None):
        return resolve_config(load_config(llm_yaml, list(overrides)), plugins or plugin_manager)

    return make
