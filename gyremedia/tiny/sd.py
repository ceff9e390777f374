"""Tiny, randomly initialised SD-1.x-style ``StableDiffusionPipeline`` and SDXL-style
``StableDiffusionXLPipeline`` replicas built offline from configs.

Stock diffusers/transformers parts only: a ``UNet2DConditionModel`` (epsilon- or v-prediction, set in its
DDIM scheduler's config), one CLIP text encoder (``CLIPTextModel``: SD 1.x conditions on its last hidden
state) with the word-level tokenizer of :func:`gyremedia.tiny.sd3.build_clip_tokenizer`, an
AutoencoderKL and a ``DDIMScheduler`` with Stable Diffusion 1.x's noise schedule. No safety checker
(``requires_safety_checker=False`` in the saved config), so ``StableDiffusionPipeline.from_pretrained(folder)``
loads an export with no other argument. The SDXL replica adds what SDXL adds: a second encoder with a
projection (``CLIPTextModelWithProjection``; the UNet cross-attends to both encoders' penultimate hidden
states side by side) whose pooled output, with the six size numbers, conditions the UNet through its
``text_time`` embedding; no watermarker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia.options import OptionError, option
from gyremedia.tiny.sd3 import DEFAULT_WORDS, build_clip_tokenizer, build_t5_tokenizer, build_tiny_vae


@dataclass
class TinySDOptions:
    """Sizes of the tiny pipeline; the defaults give about a quarter of a million parameters."""

    latent_size: int = option(8, ge=1, help="latent height and width")
    latent_channels: int = option(4, ge=1, help="latent channels")
    vae_channels: list[int] = option(default_factory=lambda: [16, 32], ge=1, help="one downsampling per extra entry")
    unet_channels: list[int] = option(
        default_factory=lambda: [16, 32],
        ge=1,
        help="UNet block widths: one downsampling per extra entry; which blocks cross-attend: `attention_blocks`",
    )
    attention_blocks: Literal["after_first", "before_last"] = option(
        "after_first",
        help="after_first: every block but the highest-resolution one cross-attends (the small "
        "default); before_last: every block but the lowest-resolution one, as SD 1.x (its "
        "attention over 64 x 64 latents at 512 pixels)",
    )
    layers_per_block: int = option(1, ge=1, help="resnet layers per UNet block")
    attention_heads: int = option(2, ge=1, help="heads of the UNet's attention layers")
    text_encoder: Literal["clip", "t5"] = option(
        "clip",
        help="clip: SD 1.x's CLIPTextModel (causal: a word's state does not see the words after it); t5: "
        "a T5EncoderModel, bidirectional, which the stock pipeline's encode_prompt calls the same way",
    )
    text_hidden_size: int = option(32, ge=1, help="width of the text encoder (the UNet's cross-attention width)")
    text_layers: int = option(2, ge=1, help="layers of the text encoder")
    text_max_length: int = option(16, ge=1, help="tokens per prompt")
    words: list[str] = option(default_factory=lambda: list(DEFAULT_WORDS), help="whole-word tokens")
    prediction_type: Literal["epsilon", "v_prediction"] = option(
        "epsilon", help="what the UNet predicts (the scheduler's prediction_type)"
    )
    zero_terminal_snr: bool = option(
        False,
        help="rescale the betas so the last timestep is pure noise and space "
        "the sampling steps from it (SD 2.x-style; needs v_prediction)",
    )
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if len(self.unet_channels) < 2:
            raise OptionError(
                "unet_channels", "give at least two widths: one block without cross-attention and one with"
            )
        if self.latent_size % 2 ** (len(self.unet_channels) - 1):
            raise OptionError(
                "latent_size",
                f"must be a multiple of {2 ** (len(self.unet_channels) - 1)} "
                "(one halving per extra unet_channels entry)",
            )
        if self.text_encoder != "clip" and isinstance(self, TinySDXLOptions):
            raise OptionError("text_encoder", "SDXL conditions on CLIP's pooled output: use text_encoder: clip")
        if self.zero_terminal_snr and self.prediction_type == "epsilon":
            raise OptionError(
                "zero_terminal_snr", "pure noise has no epsilon to predict: set prediction_type: v_prediction"
            )


@dataclass
class TinySDXLOptions(TinySDOptions):
    """The SD-1.x replica's sizes, plus the width of SDXL's size embeddings (both encoders are
    ``text_hidden_size`` wide; the second projects its pooled output to that width too)."""

    time_embed_dim: int = option(
        8, ge=1, help="width of each of the six size numbers' embeddings (the UNet's addition_time_embed_dim)"
    )


def sd_scheduler(prediction_type: str = "epsilon", zero_terminal_snr: bool = False):
    """Stable Diffusion 1.x's DDIM scheduler: scaled-linear betas 0.00085 .. 0.012 over 1000 steps, the
    "leading" spacing with offset 1, no clipping, and the last step to ``alpha_bar[0]`` (not to 1). With
    ``zero_terminal_snr`` the betas are rescaled so ``alpha_bar`` reaches 0 at the last timestep and sampling
    starts there ("trailing" spacing), as Lin et al. (2024, "Common Diffusion Noise Schedules and Sample Steps
    are Flawed") fix SD's schedule, whose last timestep leaves 0.07 of the signal."""
    from diffusers import DDIMScheduler

    spacing = {"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"} if zero_terminal_snr else {}
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type=prediction_type,
        **spacing,
    )


DOWN_TO_UP = {"DownBlock2D": "UpBlock2D", "CrossAttnDownBlock2D": "CrossAttnUpBlock2D"}


def build_tiny_sd_unet(options: TinySDOptions):
    """The UNet alone (random weights from the current RNG state); SDXL's conditioning for
    :class:`TinySDXLOptions`."""
    from diffusers import UNet2DConditionModel

    levels = len(options.unet_channels)
    attending = ["CrossAttnDownBlock2D"] * (levels - 1)
    down = ["DownBlock2D", *attending] if options.attention_blocks == "after_first" else [*attending, "DownBlock2D"]
    width, xl = options.text_hidden_size, isinstance(options, TinySDXLOptions)
    extra = (
        dict(
            addition_embed_type="text_time",
            addition_time_embed_dim=options.time_embed_dim,
            projection_class_embeddings_input_dim=6 * options.time_embed_dim + width,
        )
        if xl
        else {}
    )
    return UNet2DConditionModel(
        sample_size=options.latent_size,
        in_channels=options.latent_channels,
        out_channels=options.latent_channels,
        block_out_channels=list(options.unet_channels),
        down_block_types=down,
        up_block_types=[DOWN_TO_UP[block] for block in reversed(down)],
        layers_per_block=options.layers_per_block,
        cross_attention_dim=2 * width if xl else width,
        attention_head_dim=options.attention_heads,
        norm_num_groups=min(8, options.unet_channels[0]),
        **extra,
    )


def build_text_encoder(options: TinySDOptions):
    """The tokenizer and the text encoder whose last hidden state the UNet cross-attends to (random weights
    from the current RNG state)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    width = options.text_hidden_size
    if options.text_encoder == "t5":
        tokenizer = build_t5_tokenizer(options.words, options.text_max_length)
        config = T5Config(
            vocab_size=len(tokenizer),
            d_model=width,
            d_kv=width // 2,
            d_ff=width * 2,
            num_layers=options.text_layers,
            num_heads=2,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=options.text_max_length,
            dropout_rate=0.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return tokenizer, T5EncoderModel(config)
    tokenizer = build_clip_tokenizer(options.words, options.text_max_length)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=width * 2,
        num_attention_heads=2,
        num_hidden_layers=options.text_layers,
        max_position_embeddings=options.text_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        projection_dim=width,
    )
    return tokenizer, CLIPTextModel(config)


def build_tiny_sd_pipeline(options: TinySDOptions, vae=None):
    """Build the tiny pipeline deterministically from ``options.seed`` (``vae``: an AutoencoderKL to use
    instead of a random one, e.g. a trained one); a ``StableDiffusionXLPipeline`` for :class:`TinySDXLOptions`."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTextModelWithProjection

    xl = isinstance(options, TinySDXLOptions)
    with torch.random.fork_rng(devices=[]):  # everything is built on the CPU
        torch.manual_seed(options.seed)
        tokenizer, text_encoder = build_text_encoder(options)
        text_config = text_encoder.config
        text_encoder_2 = CLIPTextModelWithProjection(text_config) if xl else None
        unet = build_tiny_sd_unet(options)
        if vae is None:
            vae = build_tiny_vae(options.vae_channels, options.latent_channels, options.latent_size, scaling_factor=1.0)
    for part in (text_encoder, text_encoder_2, unet, vae):  # built from configs a part is in training mode
        if part is not None:
            part.eval()
    scheduler = sd_scheduler(options.prediction_type, options.zero_terminal_snr)
    if xl:
        return StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            tokenizer=tokenizer,
            tokenizer_2=build_clip_tokenizer(options.words, options.text_max_length),
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )
