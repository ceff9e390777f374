"""ParetoSlider: preference weights drawn per group, a backbone input that starts as a no-op, advantages
weighted per sample, config errors that name the fix, and the front swept after training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli_runs import gyremedia, with_threads
from gyremedia.advantages import combined_advantages
from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer
from gyremedia_features.pareto import preference_weights, sweep_weights

PARETO = ["pareto.enabled=true", "backbone.preference_inputs=2", "rewards=[jpeg_compressibility, shapes_verifier]"]


def test_weights_are_drawn_per_group_and_reproducible():
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    weights = preference_weights(0, 3, groups, 2, 1.0)
    assert weights.shape == (6, 2) and torch.allclose(weights.sum(dim=1), torch.ones(6))
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    # a group's weights depend on (seed, step, group) only: the same on another rank's slice
    assert torch.equal(preference_weights(0, 3, groups[4:], 2, 1.0), weights[4:])
    assert not torch.equal(preference_weights(0, 4, groups, 2, 1.0), weights)


def test_per_sample_weights_combine_each_groups_own_trade_off():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    groups = torch.tensor([0, 0, 1, 1])
    weights = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # group 0 wants A, group 1 wants B
    advantages = combined_advantages(rewards, weights, groups, "normalize_each")
    assert advantages[0] > 0 > advantages[1] and advantages[3] > 0 > advantages[2]


def test_the_preference_input_starts_as_a_no_op_and_never_reaches_the_reference(make_config):
    config = make_config(*PARETO, "backbone.lora.enabled=true")
    backbone = (
        PluginManager()
        .component("backbone", "flow_matching")
        .build(config.backbone.options, BuildContext(device=torch.device("cpu")))
    )
    x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    conditions = backbone.encode(["a red circle", "a blue square"])
    preferred = {**conditions, "preference": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}
    with torch.no_grad():
        plain = backbone.predict(x, torch.tensor(0.5), conditions)
        torch.testing.assert_close(backbone.predict(x, torch.tensor(0.5), preferred), plain, rtol=0, atol=0)
        torch.nn.init.normal_(backbone.preference_embedder.weight)
        assert not torch.allclose(backbone.predict(x, torch.tensor(0.5), preferred), plain)
        torch.testing.assert_close(
            backbone.predict(x, torch.tensor(0.5), preferred, reference=True),
            backbone.predict(x, torch.tensor(0.5), conditions, reference=True),
            rtol=0,
            atol=0,
        )
    state = backbone.trainable_state_dict()  # LoRA adapters plus the embedder
    assert "preference_embedder.weight" in state and any("lora" in k for k in state)
    assert backbone.preference_embedder.weight.requires_grad
    saved = backbone.preference_embedder.weight.clone()
    with torch.no_grad():
        backbone.preference_embedder.weight.zero_()
    backbone.load_trainable_state_dict(state)
    torch.testing.assert_close(backbone.preference_embedder.weight, saved)


def test_the_export_keeps_stock_weights_and_the_embedder_beside_them(make_config, tmp_path):
    config = make_config(*PARETO)
    pm, context = PluginManager(), BuildContext(device=torch.device("cpu"))
    backbone = pm.component("backbone", "flow_matching").build(config.backbone.options, context)
    with torch.no_grad():
        torch.nn.init.normal_(backbone.preference_embedder.weight)
    backbone.save_pretrained(tmp_path / "pipeline")
    from safetensors.torch import load_file

    weights = load_file(str(next((tmp_path / "pipeline" / "transformer").glob("*.safetensors"))))
    assert not any(k.startswith("preference_embedder") for k in weights)
    assert "preference_embedder" in dict(backbone.transformer.named_children())  # put back after saving
    reloaded = pm.component("backbone", "flow_matching").build(
        make_config(*PARETO, f"backbone.pretrained={tmp_path / 'pipeline'}").backbone.options, context
    )
    torch.testing.assert_close(reloaded.preference_embedder.weight, backbone.preference_embedder.weight)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["pareto.enabled=true"], "needs at least 2 rewards"),
        (
            ["pareto.enabled=true", "rewards=[jpeg_compressibility, shapes_verifier]"],
            "set backbone.preference_inputs=2",
        ),
        ([*PARETO, "pareto.sweep=1"], "pareto.sweep=1: must be >= 2"),
    ],
)
def test_bad_pareto_configs_name_the_fix(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", "\\.")):
        make_config(*overrides)


def test_sweep_weights():
    assert sweep_weights(2, 5).tolist() == [[1.0, 0.0], [0.75, 0.25], [0.5, 0.5], [0.25, 0.75], [0.0, 1.0]]
    assert sweep_weights(3, 5).shape == (4, 3)  # each reward alone and the equal mix


def test_a_pareto_run_writes_its_front(make_config, tmp_path):
    state = Trainer(make_config(*PARETO, "train.steps=2"), PluginManager()).train()
    front = json.loads((tmp_path / "run" / "pareto_front.json").read_text())
    assert [p["weights"] for p in front] == sweep_weights(2, 5).tolist()
    assert (tmp_path / "run" / "pareto_front.png").is_file()
    assert state.last_metrics["pareto/4/shapes_verifier"] == front[4]["shapes_verifier"]
    assert state.rollout.conditions["preference"].shape == (8, 2)


def test_eval_reports_the_trained_models_front(make_config, tmp_path, capsys):
    """`gyremedia eval` asks the plugins for more (gyremedia_eval_report): the pareto plugin adds the front."""
    from gyremedia.cli import main

    Trainer(make_config(*PARETO, "train.steps=1"), PluginManager()).train()
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["weights"] for p in report["pareto_front"]] == sweep_weights(2, 5).tolist()
    assert main(["eval", str(tmp_path / "run")]) == 0
    assert "preference [0.5, 0.5]: " in capsys.readouterr().out  # its lines, after the table


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_pareto_config_learns_a_front_whose_extremes_each_win_their_own_reward(tmp_path):
    """configs/pareto.yaml end to end (about 4 minutes on 2 CPU cores): one model, five preferences."""
    from gyremedia.config import load_config

    run, config = tmp_path / "pareto", Path(__file__).resolve().parents[2] / "configs" / "pareto.yaml"
    gyremedia(
        "train",
        str(config),
        f"run.output_dir={run}",
        "export.on_train_end=false",
        "logging.progress=false",
        timeout=1200,
        env=with_threads(1),
    )
    front = json.loads((run / "pareto_front.json").read_text())
    print(json.dumps(front, indent=1))
    names = [r["name"] for r in load_config(config).rewards]
    assert len(front) == 5 and (run / "pareto_front.png").is_file()
    first, last = front[0], front[-1]  # all weight on names[0] / all weight on names[1]
    assert first[names[0]] > last[names[0]] and last[names[1]] > first[names[1]]
