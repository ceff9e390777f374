"""The SD3 backbone at a size other than its transformer's sample size (Flow-GRPO trains SD3.5-M at 512 px, half
its default): our samples at that size are the stock pipeline's, and sizes the patches do not divide are refused."""

from __future__ import annotations

import pytest
import torch
from backbone_checks import ode_samples, one_thread  # noqa: F401 - an autouse fixture
from omegaconf import OmegaConf

from gyremedia.backbones.sd3 import FlowMatchingBackbone, FlowMatchingOptions
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, validate
from gyremedia.plugins import PluginManager

PROMPTS, SEEDS = ["a red circle", "a blue square"], [0, 1]


def build(**overrides) -> FlowMatchingBackbone:
    options = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(FlowMatchingOptions), {"max_sequence_length": 1, **overrides})
    )
    assert validate(options) == []
    return (
        PluginManager().component("backbone", "flow_matching").build(options, BuildContext(device=torch.device("cpu")))
    )


def test_a_chosen_size_samples_as_the_stock_pipeline_does():
    default, backbone = build(), build(height=8, width=16)
    assert default.height == default.width == 16  # the tiny transformer's sample size x the VAE factor
    assert backbone.state_shape()[1:] == (4, 8) and backbone.generation_arguments()["height"] == 8
    ours = ode_samples(backbone, PROMPTS, SEEDS, 3, 2.0).data
    stock = backbone.pipeline(
        PROMPTS,
        num_inference_steps=3,
        guidance_scale=2.0,
        output_type="pt",
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        **backbone.generation_arguments(),
    ).images
    assert ours.shape == (2, 3, 8, 16) and torch.allclose(ours, stock, atol=1e-5)


def test_sizes_the_patches_do_not_divide_are_refused():
    with pytest.raises(OptionError, match="height: must be a multiple of 4"):
        build(height=18)
