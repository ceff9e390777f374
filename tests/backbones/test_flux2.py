"""The FLUX.2 backbone on its tiny replicas ([klein] base and distilled, [dev]): our sampler reproduces the stock
Flux2KleinPipeline / Flux2Pipeline (classifier-free, ignored and embedded guidance), the schedule is the
pipeline's, the default LoRA targets wrap every block's attention and MLPs, and exports load back."""

from __future__ import annotations

import json

import pytest
import torch
from backbone_checks import check_adapters_switch_off, ode_samples, one_thread  # noqa: F401 - an autouse fixture
from omegaconf import OmegaConf

from gyremedia.backbones import flux2
from gyremedia.backbones.flux2 import Flux2Backbone, Flux2Options
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, validate
from gyremedia.tiny.flux2 import TinyFlux2Options

PROMPTS, SEEDS = ["a red circle", "two green triangles"], [5, 6]
# klein's chat template takes ~14 tokens around the prompt; [dev]'s system message ~30 before it
TEXT = {"klein-base": 32, "klein": 32, "dev": 64}


def build(variant: str = "klein-base", **overrides) -> Flux2Backbone:
    """The backbone from options merged as a run's config merges them (so the defaults are the schema's)."""
    overrides = {
        "max_sequence_length": TEXT[variant],
        **overrides,
        "tiny": {"variant": variant, **overrides.get("tiny", {})},
    }
    options = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Flux2Options), overrides))
    assert validate(options) == []
    return Flux2Backbone(options, BuildContext(device=torch.device("cpu")))


def ours(backbone: Flux2Backbone, num_steps: int, guidance_scale: float) -> torch.Tensor:
    return ode_samples(backbone, PROMPTS, SEEDS, num_steps, guidance_scale).data


def stock(backbone: Flux2Backbone, num_steps: int, guidance_scale: float) -> torch.Tensor:
    """The stock pipeline's own call, drawing its noise from the same generators (its first parameter is a
    conditioning image: the prompt goes by name)."""
    return backbone.pipeline(
        prompt=PROMPTS,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        output_type="pt",
        **backbone.generation_arguments(),
    ).images


@pytest.mark.parametrize(
    "variant, overrides, guidance_scale",
    [
        ("klein-base", {}, 1.0),  # no guidance: one forward
        ("klein-base", {}, 4.0),  # classifier-free guidance against "" (the pipeline's default scale)
        ("klein-base", {"max_sequence_length": 256}, 4.0),  # the options' default text length works too
        ("klein", {}, 4.0),  # step-distilled: the scale is ignored
        ("dev", {}, 1.0),  # embedded guidance 1: weak, still one forward
        ("dev", {}, 4.0),  # FLUX.2 [dev]'s usual embedded guidance
    ],
    ids=["klein-base-1", "klein-base-cfg-4", "klein-base-default-text-length", "klein-distilled-4", "dev-1", "dev-4"],
)
def test_our_ode_equals_the_stock_pipeline(variant, overrides, guidance_scale):
    backbone = build(variant, **overrides)
    expected = stock(backbone, 4, guidance_scale)
    torch.testing.assert_close(ours(backbone, 4, guidance_scale), expected, atol=2e-4, rtol=0)
    assert expected.shape == (2, 3, 16, 16)


@pytest.mark.parametrize("variant", ["klein-base", "dev"])
def test_sigmas_are_the_pipelines(variant):
    backbone = build(variant)
    # mu = compute_empirical_mu(16 tokens, 4 steps) = 2.0349...: FLUX.2's shift grows with the step count
    torch.testing.assert_close(
        backbone.sigmas(4), torch.tensor([1.0, 0.954515, 0.874924, 0.699854, 0.0]), atol=1e-6, rtol=0
    )
    for num_steps in (1, 4, 7):
        stock(backbone, num_steps, 1.0)
        assert torch.equal(backbone.sigmas(num_steps), backbone.pipeline.scheduler.sigmas.float())


def test_guidance_is_classifier_free_for_klein_base_only():
    base, distilled, dev = build("klein-base"), build("klein"), build("dev")
    assert base.uses_cfg(4.0) and not base.uses_cfg(1.0)
    for backbone in (distilled, dev):
        assert not backbone.uses_cfg(4.0)  # one forward, whatever the scale
    x = base.sample_noise([torch.Generator().manual_seed(s) for s in SEEDS])
    sigma = torch.tensor(0.7)
    for backbone, changes in ((base, True), (distilled, False), (dev, True)):
        conditions = backbone.encode(PROMPTS)
        same = torch.equal(backbone.predict(x, sigma, conditions, 1.0), backbone.predict(x, sigma, conditions, 4.0))
        assert same != changes
    assert distilled.distilled and not base.distilled and not dev.distilled


def test_conditions_are_per_prompt_and_the_state_is_the_patchified_latent():
    backbone = build()
    conditions = backbone.encode(PROMPTS)
    # only batch-first tensors (3 tapped layers x 16 channels): position ids are rebuilt in every forward
    assert {k: tuple(v.shape) for k, v in conditions.items()} == {"prompt_embeds": (2, 32, 48)}
    assert backbone.state_shape() == (128, 4, 4)  # 4 x 32 VAE channels per 2x2 patch of the 8x8 latent
    x = backbone.sample_noise([torch.Generator().manual_seed(0)])
    inputs = backbone.transformer_inputs(x, torch.ones(1), backbone.encode(PROMPTS[:1]), 1.0)
    assert inputs["hidden_states"].shape == (1, 16, 128) and inputs["guidance"] is None
    assert inputs["txt_ids"].shape == (1, 32, 4) and inputs["img_ids"].shape == (1, 16, 4)
    assert torch.equal(backbone.velocity(inputs["hidden_states"], x), x)  # unpacking inverts packing
    assert sum(p.numel() for p in backbone.transformer.parameters()) < 300_000
    # decode undoes the VAE's BatchNorm normalisation: the tiny one's statistics are not 0 and 1
    assert backbone.pipeline.vae.bn.running_mean.abs().max() > 0.05


def test_default_lora_targets_wrap_both_kinds_of_block_and_switch_off_to_the_base():
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = build()
    backbone = build(lora={"enabled": True})
    wrapped = {n for n, m in backbone.transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    double = {f"transformer_blocks.0.{leaf}" for leaf in flux2.FLUX2_LORA_TARGETS[:12]}
    # the single-stream block's fused q/k/v + MLP input and its output projection
    single = {"single_transformer_blocks.0.attn.to_qkv_mlp_proj", "single_transformer_blocks.0.attn.to_out"}
    assert wrapped == double | single and len(wrapped) == 14
    check_adapters_switch_off(base, backbone, 4.0, PROMPTS, SEEDS)


def test_adapters_saved_alone_load_into_the_stock_pipeline(tmp_path):
    backbone = build("dev", lora={"enabled": True})
    with torch.no_grad():
        for name, p in backbone.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    build("dev").save_pretrained(tmp_path / "base")
    backbone.save_pretrained(tmp_path / "lora", merge_lora=False)
    pipeline = backbone.stock_pipeline_class().from_pretrained(tmp_path / "base")
    pipeline.load_lora_weights(tmp_path / "lora")  # diffusers' own LoRA loader
    x = backbone.sample_noise([torch.Generator().manual_seed(s) for s in SEEDS])
    conditions, sigma = backbone.encode(PROMPTS), torch.tensor(0.6)
    with torch.no_grad():
        loaded = pipeline.transformer(
            **backbone.transformer_inputs(x, sigma.expand(2), conditions, 4.0), return_dict=False
        )[0]
    torch.testing.assert_close(
        backbone.velocity(loaded, x), backbone.predict(x, sigma, conditions, 4.0), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("variant, pipeline_class", [("klein", "Flux2KleinPipeline"), ("dev", "Flux2Pipeline")])
def test_a_saved_pipeline_loads_back_as_its_class_with_its_size(tmp_path, variant, pipeline_class):
    backbone = build(variant)
    backbone.save_pretrained(tmp_path)
    # the class comes from the folder's model_index.json, whatever the (tiny) variant option says
    loaded = build("klein-base", pretrained=str(tmp_path), max_sequence_length=TEXT[variant])
    assert (
        loaded.pipeline_class
        == pipeline_class
        == json.loads((tmp_path / "model_index.json").read_text())["_class_name"]
    )
    assert loaded.distilled == backbone.distilled and loaded.generation_arguments() == backbone.generation_arguments()
    readme = (tmp_path / "README.md").read_text()
    assert f'pipe(prompt="a prompt", height=16, width=16, max_sequence_length={TEXT[variant]})' in readme
    assert torch.equal(ours(loaded, 3, 4.0), ours(backbone, 3, 4.0))


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(OptionError, match="height"):
        build(height=18)
    options = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Flux2Options), {"negative_prompt": "ugly"}))
    assert validate(options) == [f"negative_prompt='ugly': {flux2.NO_NEGATIVE_PROMPT}"]
    assert validate(TinyFlux2Options(attention_head_dim=8)) == [
        "axes_dims_rope=[4, 4, 4, 4]: must sum to attention_head_dim=8"
    ]
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(OptionError, match="holds a FluxPipeline"):
        flux2.folder_pipeline_class(str(tmp_path))


def test_the_hook_registers_flux2():
    registered = {}
    flux2.gyremedia_register_backbones(lambda name, cls, **kw: registered.update({name: (cls, kw["options"])}))
    assert registered == {"flux2": (Flux2Backbone, Flux2Options)}
