"""Regularizers: the hinge is zero unless the norm inflates, the KL terms are zero at the reference and
positive away from it, the adaptive strength follows the reward, and under LoRA the reference
(adapters disabled) is exactly the base model."""

from __future__ import annotations

import pytest
import torch

from gyremedia.config import ConfigError
from gyremedia.interfaces import BuildContext, Transition
from gyremedia.options import validate
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer
from gyremedia_regularizers.adaptive import AdaptiveOptions, RewardAdaptiveStrength
from gyremedia_regularizers.velocity import norm_hinge, transition_kl

REGULARIZERS = "regularizers=[{name: velocity_norm_hinge, weight: 1.0}, {name: velocity_kl, weight: 0.1}]"


def test_hinge_is_exactly_zero_unless_the_norm_is_larger():
    v_ref = torch.randn(3, 4, 5)
    assert torch.equal(norm_hinge(v_ref.clone(), v_ref), torch.zeros(3))
    assert torch.equal(norm_hinge(0.5 * v_ref, v_ref), torch.zeros(3))
    larger = (1.2 * v_ref).requires_grad_(True)
    penalty = norm_hinge(larger, v_ref)
    expected = 0.2 * v_ref.pow(2).mean(dim=(1, 2)).sqrt()
    torch.testing.assert_close(penalty, expected)
    (grad,) = torch.autograd.grad(penalty.sum(), larger)
    assert (grad * larger).sum() > 0  # pushes the norm down
    smaller = (0.5 * v_ref).requires_grad_(True)
    (grad,) = torch.autograd.grad(norm_hinge(smaller, v_ref).sum(), smaller)
    assert torch.equal(grad, torch.zeros_like(grad))  # never pulls a model that does not inflate


WITH_GAUSSIAN_KL = REGULARIZERS[:-1] + ", {name: gaussian_kl, weight: 0.1}]"


def test_regularizers_are_zero_at_the_reference_and_positive_away(make_config, tmp_path):
    for objective, lora, regularizers in (("grpo", False, WITH_GAUSSIAN_KL), ("nft", True, REGULARIZERS)):
        config = make_config(
            regularizers,
            f"objective={{name: {objective}}}",
            "sampler={name: flow_sde}",
            f"backbone.lora.enabled={lora}",
            "train.steps=1",
            f"run.output_dir={tmp_path}/{objective}",
        )
        first = Trainer(config, PluginManager()).train().last_metrics
        assert first["velocity_norm_hinge/loss"] == 0.0 and first["velocity_kl/loss"] == 0.0
        assert first["velocity_norm_hinge/inflation"] == 1.0
        buckets = [k for k in first if k.startswith("velocity_norm_hinge/inflation_t")]
        assert buckets and all(first[k] == 1.0 for k in buckets)
    assert first_gaussian(make_config, tmp_path, "train.steps=1", "near") == 0.0
    assert first_gaussian(make_config, tmp_path, "train.steps=3", "far") > 0
    config = make_config(
        REGULARIZERS,
        "objective={name: nft}",
        "sampler={name: ode}",
        "train.steps=3",
        "train.learning_rate=0.01",
        f"run.output_dir={tmp_path}/away",
    )
    later = Trainer(config, PluginManager()).train().last_metrics
    assert later["velocity_kl/loss"] > 0 and later["velocity_norm_hinge/inflation"] != 1.0
    buckets = {k: v for k, v in later.items() if k.startswith("velocity_norm_hinge/inflation_t")}
    assert len(buckets) >= 2 and any(v != 1.0 for v in buckets.values())  # NFT's levels span [0, 1]


def first_gaussian(make_config, tmp_path, steps: str, name: str) -> float:
    config = make_config(
        "regularizers=[gaussian_kl]",
        "objective={name: grpo, clip_range: 0.5}",
        "train.learning_rate=0.01",
        steps,
        f"run.output_dir={tmp_path}/{name}",
    )
    return Trainer(config, PluginManager()).train().last_metrics["gaussian_kl/kl"]


def test_transition_kl_is_the_gaussian_kl():
    mean, mean_ref, std = torch.randn(3, 4), torch.randn(3, 4), torch.tensor(0.3)
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, std), torch.distributions.Normal(mean_ref, std)
    )
    torch.testing.assert_close(
        transition_kl(Transition(mean, mean, std), Transition(mean_ref, mean_ref, std)), exact.mean(dim=1)
    )
    same = Transition(mean, mean, std)
    assert torch.equal(transition_kl(same, same), torch.zeros(3))
    deterministic = Transition(mean, mean, torch.tensor(0.0))
    assert torch.equal(transition_kl(deterministic, Transition(mean_ref, mean_ref, torch.tensor(0.0))), torch.zeros(3))


def test_gaussian_kl_needs_a_ratio_objective(make_config):
    with pytest.raises(ConfigError, match="'gaussian_kl' compares replayed sampler transitions.*velocity_kl"):
        make_config("regularizers=[gaussian_kl]", "objective={name: nft}", "sampler={name: ode}")


@pytest.mark.parametrize(
    "mode,expected",
    [("relax", [1.0, 1.0, 0.55, 0.1, 0.1]), ("tighten", [0.1, 0.1, 0.55, 1.0, 1.0]), ("none", [1.0] * 5)],
)
def test_adaptive_strength_follows_the_reward(mode, expected):
    strength = RewardAdaptiveStrength(AdaptiveOptions(adapt=mode, adapt_until=0.8, min_scale=0.1, smoothing=0.0))
    scales = [strength.scale]
    for reward in (0.4, 0.6, 0.9, 0.7 + 0.1):
        strength.gyremedia_on_step_end(state=None, metrics={"reward": reward})
        scales.append(strength.scale)
    assert scales == pytest.approx(expected)
    restored = RewardAdaptiveStrength(AdaptiveOptions(adapt=mode, adapt_until=0.8, min_scale=0.1, smoothing=0.0))
    restored.load_state_dict(strength.state_dict())
    assert restored.scale == strength.scale
    assert validate(AdaptiveOptions(adapt="sometimes")) == ["adapt='sometimes': expected one of none, relax, tighten"]


def test_adaptive_kl_logs_its_strength(make_config):
    config = make_config("regularizers=[{name: velocity_kl, adapt: relax, adapt_until: 2.0}]", "train.steps=2")
    metrics = Trainer(config, PluginManager()).train().last_metrics
    assert metrics["velocity_kl/strength"] <= 1.0 and "velocity_kl/kl" in metrics


def test_lora_reference_is_the_base_model(make_config):
    pm, context = PluginManager(), BuildContext(device=torch.device("cpu"))
    with_lora = pm.component("backbone", "flow_matching").build(
        make_config("backbone.lora.enabled=true").backbone.options, context
    )
    plain = pm.component("backbone", "flow_matching").build(make_config().backbone.options, context)
    with torch.no_grad():
        for name, p in with_lora.transformer.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)  # trained adapters
    x = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    conditions = plain.encode(["a red circle", "a blue square"])
    with torch.no_grad():
        base = plain.predict(x, torch.tensor(0.6), conditions)
        reference = with_lora.predict(x, torch.tensor(0.6), conditions, reference=True)
        adapted = with_lora.predict(x, torch.tensor(0.6), conditions)
    assert torch.equal(reference, base)
    assert not torch.allclose(adapted, base)
