"""The FLUX.1 backbone on its tiny replica: our sampler reproduces the stock FluxPipeline (embedded guidance,
true CFG, schnell), the schedule is the pipeline's, and the default LoRA targets wrap attention and MLPs."""

from __future__ import annotations

import pytest
import torch
from backbone_checks import check_adapters_switch_off, ode_samples, one_thread  # noqa: F401 - an autouse fixture
from omegaconf import OmegaConf

from gyremedia.backbones import flux
from gyremedia.backbones.flux import FluxBackbone, FluxOptions
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, validate
from gyremedia.plugins import PluginManager
from gyremedia.tiny.flux import TinyFluxOptions

PLUGINS = PluginManager()
PROMPTS, SEEDS = ["a red circle", "two green triangles"], [5, 6]


def build(**overrides) -> FluxBackbone:
    """The backbone from options merged as a run's config merges them (so the defaults are the schema's)."""
    options = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FluxOptions), overrides))
    assert validate(options) == []
    return PLUGINS.component("backbone", "flux").build(options, BuildContext(device=torch.device("cpu")))


def ours(backbone: FluxBackbone, num_steps: int, guidance_scale: float) -> torch.Tensor:
    return ode_samples(backbone, PROMPTS, SEEDS, num_steps, guidance_scale).data


def stock(backbone: FluxBackbone, num_steps: int, guidance_scale: float) -> torch.Tensor:
    """The stock pipeline's own call, drawing its noise from the same generators."""
    return backbone.pipeline(
        PROMPTS,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        output_type="pt",
        **backbone.generation_arguments(),
    ).images


@pytest.mark.parametrize(
    "overrides, guidance_scale",
    [
        ({"max_sequence_length": 16}, 1.0),  # embedded guidance 1: the weakest, still one forward
        ({"max_sequence_length": 16}, 3.5),  # FLUX.1-dev's usual embedded guidance
        ({}, 3.5),  # the options' default text length (256 T5 tokens) works with the tiny encoders
        ({"max_sequence_length": 16, "true_cfg_scale": 2.0, "negative_prompt": "two"}, 3.5),  # true CFG on top
        ({"max_sequence_length": 16, "tiny": {"variant": "schnell"}}, 3.5),  # no guidance input: ignored
    ],
    ids=["embedded-1", "embedded-3.5", "default-text-length", "true-cfg", "schnell"],
)
def test_our_ode_equals_the_stock_pipeline(overrides, guidance_scale):
    backbone = build(**overrides)
    expected = stock(backbone, 4, guidance_scale)
    torch.testing.assert_close(ours(backbone, 4, guidance_scale), expected, atol=2e-4, rtol=0)
    assert expected.shape == (2, 3, 16, 16)


@pytest.mark.parametrize(
    "variant, four_steps",
    [
        ("dev", [1.0, 0.826064, 0.612866, 0.345419, 0.0]),  # mu = calculate_shift(16 tokens) = 0.459375
        ("schnell", [1.0, 0.75, 0.5, 0.25, 0.0]),  # shift 1, no dynamic shifting
    ],
)
def test_sigmas_are_the_pipelines(variant, four_steps):
    backbone = build(max_sequence_length=16, tiny={"variant": variant})
    torch.testing.assert_close(backbone.sigmas(4), torch.tensor(four_steps), atol=1e-6, rtol=0)
    for num_steps in (1, 4, 7):
        stock(backbone, num_steps, 3.5)
        assert torch.equal(backbone.sigmas(num_steps), backbone.pipeline.scheduler.sigmas.float())


def test_guidance_is_embedded_not_classifier_free():
    dev, schnell = build(max_sequence_length=16), build(max_sequence_length=16, tiny={"variant": "schnell"})
    x = dev.sample_noise([torch.Generator().manual_seed(s) for s in SEEDS])
    sigma = torch.tensor(0.7)
    for backbone in (dev, schnell):
        assert not backbone.uses_cfg(3.5) and not backbone.uses_cfg(7.0)  # one forward, whatever the scale
    conditions = dev.encode(PROMPTS)
    assert not torch.equal(dev.predict(x, sigma, conditions, 1.0), dev.predict(x, sigma, conditions, 3.5))
    assert torch.equal(schnell.predict(x, sigma, conditions, 1.0), schnell.predict(x, sigma, conditions, 3.5))
    true_cfg = build(max_sequence_length=16, true_cfg_scale=2.0)
    assert true_cfg.uses_cfg(1.0)
    assert true_cfg.generation_arguments() == {
        "height": 16,
        "width": 16,
        "max_sequence_length": 16,
        "true_cfg_scale": 2.0,
        "negative_prompt": "",
    }
    assert "true_cfg_scale" not in dev.generation_arguments()
    assert not torch.equal(true_cfg.predict(x, sigma, conditions, 3.5), dev.predict(x, sigma, conditions, 3.5))


def test_conditions_are_per_prompt_and_the_state_is_the_unpacked_latent():
    backbone = build(max_sequence_length=16)
    conditions = backbone.encode(PROMPTS)
    # only batch-first tensors: the position ids are rebuilt from the state in every forward
    assert {k: tuple(v.shape) for k, v in conditions.items()} == {
        "prompt_embeds": (2, 16, 32),
        "pooled_prompt_embeds": (2, 32),
    }
    assert backbone.state_shape() == (16, 8, 8)
    x = backbone.sample_noise([torch.Generator().manual_seed(0)])
    inputs = backbone.transformer_inputs(x, torch.ones(1), backbone.encode(PROMPTS[:1]), 3.5)
    assert inputs["hidden_states"].shape == (1, 16, 64)  # 4x4 tokens of 2x2x16 latent values
    assert torch.equal(backbone.velocity(inputs["hidden_states"], x), x)  # unpacking inverts packing
    assert sum(p.numel() for p in backbone.transformer.parameters()) < 300_000


def test_default_lora_targets_wrap_attention_and_feed_forwards_and_switch_off_to_the_base():
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = build(max_sequence_length=16)
    backbone = build(max_sequence_length=16, lora={"enabled": True})
    wrapped = {n for n, m in backbone.transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    double = {f"transformer_blocks.{i}.{leaf}" for i in range(2) for leaf in flux.FLUX_LORA_TARGETS}
    single = {
        "single_transformer_blocks.0.attn.to_q",
        "single_transformer_blocks.0.attn.to_k",
        "single_transformer_blocks.0.attn.to_v",
    }
    assert wrapped == double | single and len(wrapped) == 27  # 12 per double-stream block, q/k/v of the single
    check_adapters_switch_off(base, backbone, 3.5, PROMPTS, SEEDS)


def test_a_saved_pipeline_loads_back_with_its_size_and_samples(tmp_path):
    backbone = build(max_sequence_length=16, true_cfg_scale=2.0)
    backbone.save_pretrained(tmp_path)
    loaded = build(pretrained=str(tmp_path), max_sequence_length=16, true_cfg_scale=2.0)
    assert loaded.generation_arguments() == backbone.generation_arguments()  # the size comes from the folder
    assert "height=16, width=16, max_sequence_length=16" in (tmp_path / "README.md").read_text()
    assert torch.equal(ours(loaded, 3, 3.5), ours(backbone, 3, 3.5))


def test_sizes_that_do_not_pack_are_refused():
    with pytest.raises(OptionError, match="height"):
        build(max_sequence_length=16, height=18)
    assert validate(TinyFluxOptions(attention_head_dim=8)) == [
        "axes_dims_rope=[4, 6, 6]: must sum to attention_head_dim=8"
    ]
