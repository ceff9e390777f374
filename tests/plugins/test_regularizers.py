"""Velocity regularizers: the hinge is zero unless the norm inflates, KL is zero at the reference and
positive away from it, and under LoRA the reference (adapters disabled) is exactly the base model."""

from __future__ import annotations

import torch

from gyremedia.interfaces import BuildContext
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer
from gyremedia_regularizers.velocity import norm_hinge

REGULARIZERS = "regularizers=[{name: velocity_norm_hinge, weight: 1.0}, {name: velocity_kl, weight: 0.1}]"


def test_hinge_is_exactly_zero_unless_the_norm_is_larger():
    v_ref = torch.randn(3, 4, 5)
    assert torch.equal(norm_hinge(v_ref.clone(), v_ref), torch.zeros(3))
    assert torch.equal(norm_hinge(0.5 * v_ref, v_ref), torch.zeros(3))
    larger = (1.2 * v_ref).requires_grad_(True)
    penalty = norm_hinge(larger, v_ref)
    expected = 0.2 * v_ref.pow(2).mean(dim=(1, 2)).sqrt()
    torch.testing.assert_close(penalty, expected)
    grad, = torch.autograd.grad(penalty.sum(), larger)
    assert (grad * larger).sum() > 0  # pushes the norm down
    smaller = (0.5 * v_ref).requires_grad_(True)
    grad, = torch.autograd.grad(norm_hinge(smaller, v_ref).sum(), smaller)
    assert torch.equal(grad, torch.zeros_like(grad))  # never pulls a model that does not inflate


def test_regularizers_are_zero_at_the_reference_and_positive_away(make_config, tmp_path):
    for objective, lora in (("grpo", False), ("nft", True)):
        config = make_config(REGULARIZERS, f"objective={{name: {objective}}}", "sampler={name: flow_sde}",
                             f"backbone.lora.enabled={lora}", "train.steps=1", f"run.output_dir={tmp_path}/{objective}")
        first = Trainer(config, PluginManager()).train().last_metrics
        assert first["velocity_norm_hinge/loss"] == 0.0 and first["velocity_kl/loss"] == 0.0
        assert first["velocity_norm_hinge/inflation"] == 1.0
    config = make_config(REGULARIZERS, "objective={name: nft}", "sampler={name: ode}", "train.steps=3",
                         "train.learning_rate=0.01", f"run.output_dir={tmp_path}/away")
    later = Trainer(config, PluginManager()).train().last_metrics
    assert later["velocity_kl/loss"] > 0 and later["velocity_norm_hinge/inflation"] != 1.0


def test_lora_reference_is_the_base_model(make_config):
    pm, context = PluginManager(), BuildContext(device=torch.device("cpu"))
    with_lora = pm.component("backbone", "flow_matching").build(make_config("backbone.lora.enabled=true").backbone.options, context)
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
