"""A tiny, randomly initialised ``FluxPipeline`` (FLUX.1) built offline from configs.

Made of the stock diffusers/transformers parts (FLUX transformer, a CLIP text encoder for the pooled
embedding, a real one-layer T5 for the token embeddings, an AutoencoderKL with FLUX.1's 16 latent channels
and latent statistics), so everything trained on it exports to a folder that ``FluxPipeline.from_pretrained``
loads without gyremedia.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia.options import OptionError, option
from gyremedia.tiny.sd3 import DEFAULT_WORDS, build_clip_tokenizer, build_t5_tokenizer, build_tiny_vae

# FLUX.1's VAE latent statistics (AutoencoderKL of black-forest-labs/FLUX.1-dev)
FLUX_VAE_SCALING, FLUX_VAE_SHIFT = 0.3611, 0.1159
# FLUX.1-dev's scheduler: the shift mu grows linearly with the number of packed image tokens
FLUX_DEV_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
FLUX_SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


@dataclass
class TinyFluxOptions:
    """Sizes of the tiny FLUX.1 pipeline; the defaults give a transformer of about 120k parameters."""

    variant: Literal["dev", "schnell"] = option(
        "dev", help="dev: guidance embedding and resolution-dependent shift; schnell: neither (shift 1)"
    )
    latent_size: int = option(8, ge=2, help="latent height and width (even: FLUX packs 2x2 patches)")
    latent_channels: int = option(16, ge=1, help="latent channels (FLUX.1: 16)")
    vae_channels: list[int] = option(default_factory=lambda: [16, 32], ge=1, help="one downsampling per extra entry")
    num_layers: int = option(2, ge=1, help="double-stream (text and image) transformer blocks")
    num_single_layers: int = option(1, ge=0, help="single-stream transformer blocks")
    num_attention_heads: int = option(2, ge=1, help="attention heads")
    attention_head_dim: int = option(16, ge=1, help="channels per head")
    axes_dims_rope: list[int] = option(
        default_factory=lambda: [4, 6, 6],
        ge=2,
        help="rotary channels per position axis (text, row, column): even, summing to attention_head_dim",
    )
    text_hidden_size: int = option(32, ge=1, help="width of the CLIP and T5 text encoders")
    text_layers: int = option(2, ge=1, help="layers of the CLIP text encoder (the T5 has one)")
    text_max_length: int = option(16, ge=1, help="CLIP tokens per prompt (T5 tokens: backbone.max_sequence_length)")
    words: list[str] = option(default_factory=lambda: list(DEFAULT_WORDS), help="whole-word tokens")
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if self.latent_size % 2:
            raise OptionError("latent_size", "must be even: FLUX packs 2x2 latent patches into one token")
        if len(self.axes_dims_rope) != 3 or any(d % 2 for d in self.axes_dims_rope):
            raise OptionError("axes_dims_rope", "give three even numbers (text, row, column)")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise OptionError("axes_dims_rope", f"must sum to attention_head_dim={self.attention_head_dim}")


def build_tiny_flux_pipeline(options: TinyFluxOptions):
    """Build the tiny pipeline deterministically from ``options.seed``, every part in eval mode."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    width = options.text_hidden_size
    with torch.random.fork_rng(devices=[]):  # no CUDA devices: everything is built on the CPU
        torch.manual_seed(options.seed)
        tokenizer = build_clip_tokenizer(options.words, options.text_max_length)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=width,
                intermediate_size=2 * width,
                projection_dim=width,
                num_attention_heads=2,
                num_hidden_layers=options.text_layers,
                max_position_embeddings=options.text_max_length,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        # T5 has relative positions: it encodes any backbone.max_sequence_length, whatever this length
        tokenizer_2 = build_t5_tokenizer(options.words, options.text_max_length)
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=width,
                d_kv=8,
                d_ff=2 * width,
                num_layers=1,
                num_heads=2,
                pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
            )
        )
        # FLUX.1's VAE has no quant convs either
        vae = build_tiny_vae(
            options.vae_channels,
            options.latent_channels,
            options.latent_size,
            scaling_factor=FLUX_VAE_SCALING,
            shift_factor=FLUX_VAE_SHIFT,
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * options.latent_channels,  # a token is a packed 2x2 latent patch
            num_layers=options.num_layers,
            num_single_layers=options.num_single_layers,
            attention_head_dim=options.attention_head_dim,
            num_attention_heads=options.num_attention_heads,
            joint_attention_dim=width,
            pooled_projection_dim=width,  # T5 token width, CLIP pooled width
            guidance_embeds=options.variant == "dev",
            axes_dims_rope=tuple(options.axes_dims_rope),
        )
    scheduler = FlowMatchEulerDiscreteScheduler(
        **(FLUX_DEV_SCHEDULER if options.variant == "dev" else FLUX_SCHNELL_SCHEDULER)
    )
    # built from configs every part is in training mode (T5's dropout would be live); loaded ones are not
    for part in (text_encoder, text_encoder_2, vae, transformer):
        part.eval()
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
        image_encoder=None,
        feature_extractor=None,
    )
