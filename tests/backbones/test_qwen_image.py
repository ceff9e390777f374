"""The Qwen-Image backbone on its tiny offline replica, against diffusers' own QwenImagePipeline: the samples
(without guidance and with true CFG), the dynamically shifted schedule, the tokenizer's template prefix, LoRA."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from gyremedia.backbones import qwen_image
from gyremedia.backbones.qwen_image import (
    LORA_TARGETS,
    TinyQwenImageOptions,
    build_qwen2_tokenizer,
    build_tiny_qwen_image_pipeline,
)
from gyremedia.backbones.transformer_policy import adapters_disabled
from gyremedia.interfaces import BuildContext
from gyremedia.plugins import PluginManager
from gyremedia.sampling import sample_trajectories
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_shapes.world import VOCABULARY

PROMPTS = ["a red circle", "two green triangles above a blue square"]  # of different lengths: padding is exercised
SEEDS = [5, 6]


@pytest.fixture(scope="module")
def pm() -> PluginManager:
    """Plugins with this backbone: from its entry point once installed, else registered here."""
    installed = any(e.name == "qwen_image" for e in importlib.metadata.entry_points(group="gyremedia"))
    return PluginManager() if installed else PluginManager(extra_plugins=[qwen_image])


@pytest.fixture
def build(make_config, pm):
    """The backbone a run config with ``backbone={name: qwen_image}`` and ``overrides`` builds."""

    def make(*overrides: str):
        config = make_config("backbone={name: qwen_image}", *overrides, plugins=pm)
        return pm.build(config.backbone, BuildContext(device=torch.device("cpu")))

    return make


def generators() -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in SEEDS]


@pytest.mark.parametrize(
    "guidance_scale, overrides, lengths",
    [
        (1.0, [], [8, 12]),  # each prompt's own tokens and the template's last 5, padded to tiny.max_sequence_length 16
        (4.0, ["backbone.height=16", "backbone.width=24", "backbone.max_sequence_length=10"], [8, 10]),  # one cut
    ],
    ids=["no-guidance", "true-cfg-non-square-truncated"],
)
def test_our_ode_samples_equal_the_stock_pipelines(build, guidance_scale, overrides, lengths):
    backbone = build(*overrides)
    conditions = backbone.encode(PROMPTS)
    assert conditions["prompt_embeds"].shape == (2, backbone.max_sequence_length, 16)
    assert conditions["prompt_embeds_mask"].sum(-1).tolist() == lengths
    states, _, _ = sample_trajectories(
        backbone,
        EulerODESampler(),
        conditions,
        initial_generators=generators(),
        step_generators=[],
        num_steps=3,
        guidance_scale=guidance_scale,
    )
    ours = backbone.decode(states[:, -1]).data

    # the stock call: the same noise from the same generators; true CFG is its true_cfg_scale with a negative prompt
    stock = backbone.pipeline(
        PROMPTS,
        negative_prompt=[backbone.options.negative_prompt] * 2,
        true_cfg_scale=guidance_scale,
        num_inference_steps=3,
        generator=generators(),
        output_type="pt",
        **backbone.generation_arguments(),
    ).images
    assert ours.shape == stock.shape == (2, 3, 16, 24 if overrides else 16)
    torch.testing.assert_close(ours, stock, atol=2e-4, rtol=0)


def test_sigmas_are_the_stock_pipelines_dynamically_shifted_schedule(build):
    for overrides, steps in (([], 4), (["backbone.height=32", "backbone.width=64"], 7)):
        backbone = build(*overrides)
        backbone.pipeline(
            PROMPTS[:1],
            true_cfg_scale=1.0,
            num_inference_steps=steps,
            output_type="latent",
            **backbone.generation_arguments(),
        )
        assert backbone.sigmas(steps).shape == (steps + 1,)
        torch.testing.assert_close(backbone.sigmas(steps), backbone.pipeline.scheduler.sigmas.float(), atol=0, rtol=0)
        if not overrides:  # mu = 0.4879 for 16 image tokens; the last sigma is stretched to shift_terminal 0.02
            torch.testing.assert_close(
                backbone.sigmas(4), torch.tensor([1.0, 0.743131, 0.424813, 0.02, 0.0]), atol=1e-6, rtol=0
            )


def test_lora_defaults_wrap_both_streams_attention_and_feed_forward(build):
    from peft.tuners.tuners_utils import BaseTunerLayer

    base, lora = build(), build("backbone.lora.enabled=true")
    wrapped = [name for name, m in lora.transformer.named_modules() if isinstance(m, BaseTunerLayer)]
    layers = base.transformer.config.num_layers
    for target in LORA_TARGETS:  # every default name matches one layer per block
        assert sum(name.endswith(f".{target}") for name in wrapped) == layers, target
    assert len(wrapped) == len(LORA_TARGETS) * layers == 24

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA's B starts at zero: make the adapters change the output
        for name, p in lora.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
        x, sigma, conditions = base.sample_noise(generators()), torch.tensor(0.6), base.encode(PROMPTS)
        expected = base.predict(x, sigma, conditions, 4.0)
        adapted = lora.predict(x, sigma, conditions, 4.0)
        with adapters_disabled(lora.transformer):
            disabled = lora.predict(x, sigma, conditions, 4.0)
        reference = lora.predict(x, sigma, conditions, 4.0, reference=True)
    assert (adapted - expected).abs().max() > 1e-2
    torch.testing.assert_close(disabled, expected, atol=0, rtol=0)
    torch.testing.assert_close(reference, expected, atol=0, rtol=0)


def test_tokenizer_gives_the_templates_34_prefix_tokens_and_whole_words(tmp_path):
    from transformers import Qwen2Tokenizer

    pipeline = build_tiny_qwen_image_pipeline(TinyQwenImageOptions(words=VOCABULARY))
    tokenizer = pipeline.tokenizer
    prefix, suffix = pipeline.prompt_template_encode.split("{}")
    assert len(tokenizer(prefix).input_ids) == pipeline.prompt_template_encode_start_idx == 34
    assert len(tokenizer(suffix).input_ids) == 5  # what the embeddings keep besides the prompt's own tokens
    for word in VOCABULARY:
        assert len(tokenizer(word).input_ids) == len(tokenizer(f" {word}").input_ids) == 1, word
    assert tokenizer.convert_ids_to_tokens(tokenizer("a red hexagon").input_ids)[:2] == ["a", "Ġred"]
    assert len(tokenizer("zebra").input_ids) > 1  # an unknown word falls back to byte pieces

    tokenizer.save_pretrained(tmp_path)
    text = pipeline.prompt_template_encode.format("two blue squares")
    assert Qwen2Tokenizer.from_pretrained(tmp_path)(text).input_ids == tokenizer(text).input_ids
    assert build_qwen2_tokenizer(VOCABULARY).get_vocab() == tokenizer.get_vocab()  # deterministic


def test_build_is_deterministic_per_seed_and_in_eval_mode():
    small = dict(num_layers=1, text_layers=1)
    a, b = (build_tiny_qwen_image_pipeline(TinyQwenImageOptions(**small, seed=3)) for _ in range(2))
    c = build_tiny_qwen_image_pipeline(TinyQwenImageOptions(**small, seed=4))
    for name in ("transformer", "vae", "text_encoder"):
        first = [next(getattr(p, name).parameters()) for p in (a, b, c)]
        assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2]), name
        assert not any(m.training for m in getattr(a, name).modules()), name
    assert (
        sum(p.numel() for p in build_tiny_qwen_image_pipeline(TinyQwenImageOptions()).transformer.parameters())
        < 300_000
    )
