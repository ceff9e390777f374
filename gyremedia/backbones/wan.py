"""Flow-matching text-to-video backbone on diffusers' Wan 2.1 family (``WanPipeline``).

Loads a ``WanPipeline`` folder or hub id (Wan 2.1, or a single-transformer Wan 2.2 such as TI2V-5B), or builds
a tiny one offline from stock parts, and trains its transformer (see :mod:`gyremedia.backbones.diffusers_pipeline`
for what every diffusers flow backbone shares). The state is one clip's latent ``[C, F_latent, h, w]``, the
layout the pipeline draws its noise in, so the same generators give the same clip. Guidance is true
classifier-free guidance with ``negative_prompt``, as in the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.backbones.diffusers_pipeline import DiffusersFlowPolicy, PipelineOptions, unit_range
from gyremedia.backbones.transformer_policy import LoraOptions
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option
from gyremedia.rollout import Media
from gyremedia.tiny.sd3 import DEFAULT_WORDS, build_t5_tokenizer

# the Wan VAEs' fixed compression: 4x in time (clips of 1 + 4k frames), at least 8x in space
TEMPORAL_FACTOR = 4
MIN_SPATIAL_FACTOR = 16  # 8x VAE times the transformer's 2x2 patch (TI2V-5B: 16x VAE, so 32)
# self- and cross-attention (attn1, attn2) and the feed-forward of every block
WAN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


@dataclass
class TinyWanOptions:
    """Sizes of the tiny pipeline; the defaults give about 20k transformer parameters."""

    latent_channels: int = option(4, ge=1, help="latent channels (the VAE's z_dim)")
    vae_base_dim: int = option(4, ge=1, help="channels of the VAE's first stage")
    num_layers: int = option(2, ge=1, help="transformer blocks")
    num_attention_heads: int = option(2, ge=1, help="attention heads")
    attention_head_dim: int = option(12, ge=6, help="channels per head (even: split over time, height, width)")
    ffn_dim: int = option(32, ge=1, help="feed-forward width")
    text_hidden_size: int = option(32, ge=1, help="width of the UMT5 text encoder")
    text_layers: int = option(1, ge=1, help="layers of the UMT5 text encoder")
    text_max_length: int = option(
        16, ge=1, help="the tokenizer's model_max_length (the pipeline pads to max_sequence_length anyway)"
    )
    words: list[str] = option(default_factory=lambda: list(DEFAULT_WORDS), help="whole-word tokens")
    shift: float = option(3.0, gt=0, help="the scheduler's sigma shift (Wan 2.1 480p: 3, 720p: 5)")
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if self.attention_head_dim % 2:
            raise OptionError("attention_head_dim", "must be even (rotary embedding pairs)")


@dataclass
class WanOptions(PipelineOptions):
    tiny: TinyWanOptions = field(default_factory=TinyWanOptions)
    # Wan was trained with 512 text tokens; padding tokens are attended to, so the length changes the output
    max_sequence_length: int = option(512, ge=1, help="text tokens per prompt (the pipeline's max_sequence_length)")
    num_frames: int = option(5, ge=1, help="frames per clip, 1 + 4k (Wan 2.1: 81)")
    height: int = option(32, ge=16, help="frame height in pixels, a multiple of 16 (Wan 2.1: 480)")
    width: int = option(32, ge=16, help="frame width in pixels, a multiple of 16 (Wan 2.1: 832)")
    fps: int = option(16, ge=1, help="playback rate of the decoded clips (Wan 2.1: 16, Wan 2.2 TI2V-5B: 24)")
    lora: LoraOptions = field(default_factory=lambda: LoraOptions(target_modules=list(WAN_LORA_TARGETS)))

    def validate(self) -> None:
        super().validate()
        if self.num_frames % TEMPORAL_FACTOR != 1:
            raise OptionError(
                "num_frames",
                f"must be 1 + {TEMPORAL_FACTOR}k (the VAE compresses time {TEMPORAL_FACTOR}x), e.g. 5, 17, 81",
            )
        for name in ("height", "width"):
            if getattr(self, name) % MIN_SPATIAL_FACTOR:
                raise OptionError(name, f"must be a multiple of {MIN_SPATIAL_FACTOR}")


def build_tiny_wan_pipeline(options: TinyWanOptions):
    """Build a tiny ``WanPipeline`` (UMT5, AutoencoderKLWan 8x/4x, WanTransformer3DModel) deterministically from
    ``options.seed``, every part in eval mode (UMT5's dropout would otherwise be live)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):  # everything is built on the CPU
        torch.manual_seed(options.seed)
        tokenizer = build_t5_tokenizer(options.words, options.text_max_length)
        text_encoder = UMT5EncoderModel(
            UMT5Config(
                vocab_size=len(tokenizer),
                d_model=options.text_hidden_size,
                d_kv=8,
                d_ff=options.text_hidden_size,
                num_layers=options.text_layers,
                num_heads=2,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=16,
                feed_forward_proj="gated-gelu",
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                decoder_start_token_id=0,
            )
        )
        z = options.latent_channels
        # per-channel latent statistics away from 0 and 1, so decoding exercises the pipeline's normalisation
        latents_mean = (0.2 * torch.randn(z)).tolist()
        latents_std = (0.5 + torch.rand(z)).tolist()
        vae = AutoencoderKLWan(
            base_dim=options.vae_base_dim,
            z_dim=z,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=latents_mean,
            latents_std=latents_std,
        )
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=options.num_attention_heads,
            attention_head_dim=options.attention_head_dim,
            in_channels=z,
            out_channels=z,
            text_dim=options.text_hidden_size,
            freq_dim=32,
            ffn_dim=options.ffn_dim,
            num_layers=options.num_layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
        )
    for part in (text_encoder, vae, transformer):
        part.eval()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=options.shift),
    )


class WanBackbone(DiffusersFlowPolicy):
    """A Wan 2.1-family pipeline seen as a policy over denoising transitions of a clip's latent."""

    media_kind = "video"
    pipeline_class = "WanPipeline"
    timestep_scale = 1000.0  # Wan's timestep is 1000 sigma, like SD3

    def __init__(self, options: WanOptions, context: BuildContext) -> None:
        if options.pretrained:
            self._refuse_two_experts(options.pretrained)
        super().__init__(options, context)
        self._unipc_shift = self._use_euler_scheduler()
        self._check_sizes()

    def build_tiny(self, options: WanOptions):
        return build_tiny_wan_pipeline(options.tiny)

    def _refuse_two_experts(self, pretrained: str) -> None:
        """Fail before loading any weights on a Wan 2.2 A14B folder (a high- and a low-noise transformer)."""
        index = self.stock_pipeline_class().load_config(pretrained)
        expert = index.get("transformer_2")
        if isinstance(expert, (list, tuple)) and expert and expert[0] is not None:
            raise ValueError(
                f"{pretrained} is a Wan 2.2 A14B expert pair (transformer + transformer_2, boundary_ratio "
                f"{index.get('boundary_ratio')}): expert pairs are not supported yet; single-transformer "
                "Wan 2.1 and Wan 2.2 TI2V-5B folders are"
            )

    def _use_euler_scheduler(self) -> float | None:
        """Replace a stock Wan folder's UniPC multistep solver by Euler steps with the same sigma shift.

        Our samplers take Euler(-Maruyama) steps over ``scheduler.sigmas``; the export then carries this scheduler,
        so the stock pipeline samples as training did. Returns the UniPC ``flow_shift`` it replaced, or None.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = self.scheduler
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            return None
        config = scheduler.config
        if type(scheduler).__name__ != "UniPCMultistepScheduler" or config.get("prediction_type") != "flow_prediction":
            raise ValueError(
                f"scheduler {type(scheduler).__name__} is not supported: expected "
                "FlowMatchEulerDiscreteScheduler or Wan's flow-prediction UniPCMultistepScheduler"
            )
        # from_config would read UniPC's `flow_shift` as nothing and keep shift=1: name it explicitly
        euler = FlowMatchEulerDiscreteScheduler(shift=config.flow_shift, num_train_timesteps=config.num_train_timesteps)
        self.pipeline.scheduler = self.scheduler = euler  # the pipeline's setter also updates its model_index entry
        return float(config.flow_shift)

    def _check_sizes(self) -> None:
        """Height and width this checkpoint takes as they are (the pipeline would round them down with a warning;
        TI2V-5B's 16x VAE needs multiples of 32)."""
        spatial = self.pipeline.vae_scale_factor_spatial * self.transformer.config.patch_size[1]
        for name in ("height", "width"):
            if getattr(self.options, name) % spatial:
                raise OptionError(name, f"must be a multiple of {spatial} for this checkpoint")

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        # [L, text_dim]: the pipeline cuts the encoder's output at the prompt's length and zero-pads it to L
        embeds, _ = self.pipeline.encode_prompt(
            prompt=[prompt],
            do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length,
            device=self.encoder_device,
        )
        return {"prompt_embeds": embeds[0]}

    def state_shape(self) -> tuple[int, ...]:
        frames = (self.options.num_frames - 1) // self.pipeline.vae_scale_factor_temporal + 1
        spatial = self.pipeline.vae_scale_factor_spatial
        return (
            self.transformer.config.in_channels,
            frames,
            self.options.height // spatial,
            self.options.width // spatial,
        )

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        if self.pipeline.config.expand_timesteps:
            # Wan 2.2 TI2V-5B: one timestep per latent token, [B, tokens]
            p_t, p_h, p_w = self.transformer.config.patch_size
            _, _, frames, height, width = x.shape
            timestep = timestep[:, None].expand(-1, (frames // p_t) * (height // p_h) * (width // p_w))
        return {"hidden_states": x, "timestep": timestep, "encoder_hidden_states": conditions["prompt_embeds"]}

    def generation_arguments(self) -> dict[str, Any]:
        # max_sequence_length always: the pipeline's __call__ defaults to 512, its encode_prompt to 226
        return {
            "num_frames": self.options.num_frames,
            "height": self.options.height,
            "width": self.options.width,
            "max_sequence_length": self.options.max_sequence_length,
            "negative_prompt": self.options.negative_prompt,
        }

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        """Video media ``[B, T, 3, H, W]`` in [0, 1], float32: the pipeline's ``output_type="pt"`` frames."""
        vae = self.pipeline.vae
        latents = final.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents)
        # the same expression as the pipeline (dividing by 1/std, not multiplying by std: the same bits)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
        frames = unit_range(video).permute(0, 2, 1, 3, 4)
        return Media("video", frames, {"fps": self.options.fps})

    def usage(self, out_dir: Path, adapters_only: bool) -> str:
        text = super().usage(out_dir, adapters_only)
        if self._unipc_shift is None:
            return text
        shift = self._unipc_shift
        if adapters_only:
            return text + (
                "\nThe base checkpoint ships UniPCMultistepScheduler; this model was trained with Euler "
                f"steps at its flow_shift={shift}. Sample with those:\n\n```python\n"
                "from diffusers import FlowMatchEulerDiscreteScheduler\n\n"
                f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={shift})\n```\n"
            )
        return text + (
            f"\nThe folder's scheduler is FlowMatchEulerDiscreteScheduler(shift={shift}), the Euler steps "
            f"this model was trained with, in place of the base checkpoint's UniPCMultistepScheduler "
            f"(flow_shift={shift}).\n"
        )


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "wan",
        WanBackbone,
        options=WanOptions,
        description="Wan 2.1-family rectified-flow text-to-video (diffusers WanPipeline), full or LoRA",
    )
