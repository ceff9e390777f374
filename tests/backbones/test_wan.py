"""The Wan 2.1 text-to-video backbone on its tiny replica: our sampler against the stock WanPipeline, its sigmas,
its LoRA targets, and what it does with stock Wan folders (UniPC scheduler, Wan 2.2 expert pairs)."""

from __future__ import annotations

import json

import pytest
import torch
from backbone_checks import ode_samples, one_thread  # noqa: F401 - an autouse fixture

from gyremedia.backbones import wan
from gyremedia.backbones.transformer_policy import LoraOptions, adapters_disabled
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError
from gyremedia.plugins import PluginManager

PROMPTS, SEEDS = ["a red circle", "two green triangles"], [5, 6]
TEXT = 16  # text tokens: short, and not the pipeline's default (512), so generation_arguments must carry it


def build(**overrides) -> wan.WanBackbone:
    options = wan.WanOptions(**{"max_sequence_length": TEXT, **overrides})
    options.validate()
    pm = PluginManager()
    return pm.component("backbone", "wan").build(options, BuildContext(device=torch.device("cpu")))


@pytest.fixture(scope="module")
def backbone() -> wan.WanBackbone:
    return build(negative_prompt="blue squares")


def ours(backbone: wan.WanBackbone, guidance_scale: float, num_steps: int = 4):
    """The clips our Euler ODE sampler generates from the seeds' noise."""
    return ode_samples(backbone, PROMPTS, SEEDS, num_steps, guidance_scale)


def stock(backbone: wan.WanBackbone, guidance_scale: float, num_steps: int = 4) -> torch.Tensor:
    """The stock pipeline's own call with the same seeds and the arguments the backbone says it trains with."""
    return backbone.pipeline(
        PROMPTS,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        output_type="pt",
        **backbone.generation_arguments(),
    ).frames


@pytest.mark.parametrize("guidance_scale", [1.0, 5.0], ids=["no-guidance", "cfg"])
def test_our_ode_generates_the_stock_pipelines_clips(backbone, guidance_scale):
    media = ours(backbone, guidance_scale)
    assert media.kind == "video" and media.meta == {"fps": 16}
    assert media.data.dtype == torch.float32 and media.data.shape == (2, 5, 3, 32, 32)  # [B, T, 3, H, W]
    assert 0 <= media.data.min() and media.data.max() <= 1
    # CFG batches the two branches in one forward (the pipeline runs two): ~1e-6 apart
    torch.testing.assert_close(media.data, stock(backbone, guidance_scale).float(), atol=2e-4, rtol=0)


def test_guidance_and_the_negative_prompt_change_the_clip(backbone):
    unguided, guided = ours(backbone, 1.0).data, ours(backbone, 5.0).data
    assert (unguided - guided).abs().max() > 1e-2
    other_negative = build(negative_prompt="")
    assert (ours(other_negative, 5.0).data - guided).abs().max() > 1e-3


@pytest.mark.parametrize("num_steps", [3, 10])
def test_sigmas_are_the_stock_pipelines(backbone, num_steps):
    stock(backbone, 1.0, num_steps)
    expected = backbone.pipeline.scheduler.sigmas.float()
    torch.testing.assert_close(backbone.sigmas(num_steps), expected, atol=0, rtol=0)
    assert backbone.sigmas(num_steps)[0] == 1 and backbone.sigmas(num_steps)[-1] == 0


def test_lora_wraps_attention_and_feed_forward_and_disabling_gives_the_base():
    from peft.tuners.tuners_utils import BaseTunerLayer

    backbone = build(lora=LoraOptions(enabled=True, target_modules=list(wan.WAN_LORA_TARGETS)))
    assert wan.WanOptions().lora.target_modules == wan.WAN_LORA_TARGETS  # the default
    wrapped = {n for n, m in backbone.transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    per_block = {f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")}
    per_block |= {"ffn.net.0.proj", "ffn.net.2"}
    layers = backbone.transformer.config.num_layers
    assert wrapped == {f"blocks.{b}.{p}" for b in range(layers) for p in per_block}  # 10 per block

    conditions = backbone.encode(PROMPTS)
    x = backbone.sample_noise([torch.Generator().manual_seed(s) for s in SEEDS])
    sigma = torch.tensor(0.7)
    with torch.no_grad():
        base = backbone.predict(x, sigma, conditions, 5.0)  # lora_B starts at zero
        for name, p in backbone.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
        trained = backbone.predict(x, sigma, conditions, 5.0)
        reference = backbone.predict(x, sigma, conditions, 5.0, reference=True)
        with adapters_disabled(backbone.transformer):
            disabled = backbone.predict(x, sigma, conditions, 5.0)
    assert (trained - base).abs().max() > 1e-2
    torch.testing.assert_close(disabled, base, atol=0, rtol=0)
    torch.testing.assert_close(reference, base, atol=0, rtol=0)


def test_sizes_are_validated_not_rounded():
    with pytest.raises(OptionError, match="num_frames"):
        wan.WanOptions(num_frames=8).validate()
    with pytest.raises(OptionError, match="height"):
        wan.WanOptions(height=40).validate()
    with pytest.raises(OptionError, match="attention_head_dim"):
        wan.TinyWanOptions(attention_head_dim=9).validate()


@pytest.fixture(scope="module")
def unipc_folder(tmp_path_factory):
    """A tiny Wan folder with the scheduler stock Wan checkpoints ship: flow-prediction UniPC."""
    from diffusers import UniPCMultistepScheduler

    folder = tmp_path_factory.mktemp("wan-unipc")
    pipeline = wan.build_tiny_wan_pipeline(wan.TinyWanOptions())
    pipeline.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0, num_train_timesteps=1000
    )
    pipeline.save_pretrained(folder)
    return folder


def test_a_unipc_folder_samples_and_exports_with_euler_at_its_flow_shift(unipc_folder, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    backbone = build(pretrained=str(unipc_folder))
    assert isinstance(backbone.scheduler, FlowMatchEulerDiscreteScheduler)
    assert backbone.pipeline.scheduler is backbone.scheduler and backbone.scheduler.config.shift == 5.0
    euler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    euler.set_timesteps(4)
    torch.testing.assert_close(backbone.sigmas(4), euler.sigmas.float(), atol=0, rtol=0)
    backbone.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())["shift"] == 5.0
    readme = (tmp_path / "README.md").read_text()
    assert "FlowMatchEulerDiscreteScheduler(shift=5.0)" in readme and "max_sequence_length=16" in readme


def test_a_wan22_expert_pair_is_refused_before_loading(unipc_folder, tmp_path):
    index = json.loads((unipc_folder / "model_index.json").read_text())
    index |= {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}
    (tmp_path / "model_index.json").write_text(json.dumps(index))  # no weights: it must not get that far
    with pytest.raises(ValueError, match="Wan 2.2 A14B expert pair"):
        build(pretrained=str(tmp_path))
