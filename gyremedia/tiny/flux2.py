"""A tiny, randomly initialised FLUX.2 pipeline built offline from configs.

FLUX.2 [klein] is a ``Flux2KleinPipeline`` (a Qwen3 causal LM as text encoder, base or step-distilled);
FLUX.2 [dev] a ``Flux2Pipeline`` (a Mistral3 vision-language model behind a ``PixtralProcessor``). Both share the
FLUX.2 transformer and the ``AutoencoderKLFlux2`` with its BatchNorm latent statistics. Made of stock parts only,
so everything trained on it exports to a folder that the pipeline's ``from_pretrained`` loads without gyremedia.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia.backbones.qwen_image import build_qwen2_tokenizer
from gyremedia.options import OptionError, option
from gyremedia.tiny.flux import FLUX_DEV_SCHEDULER
from gyremedia.tiny.sd3 import DEFAULT_WORDS

# The pipelines concatenate the text encoder's hidden states after these layers (their default
# text_encoder_out_layers, which a folder does not store): the tiny encoders are just deep enough, so an
# export generates with no extra argument.
KLEIN_OUT_LAYERS, DEV_OUT_LAYERS = (9, 18, 27), (10, 20, 30)

# What Qwen3's chat template renders for one user message with add_generation_prompt=True and
# enable_thinking=False (how Flux2KleinPipeline formats every prompt)
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN3_THINKING_TOKENS = ["<think>", "</think>"]

# Mistral-Small-3.1's special tokens and chat template, reduced to what Flux2Pipeline sends (format_input: a
# system message, then a user message whose content is a list of text and image parts)
MISTRAL_SPECIAL_TOKENS = [
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
]
MISTRAL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}"
    "{%- for c in message['content'] %}{%- if c['type'] == 'text' %}{{- c['text'] }}{%- endif %}{%- endfor %}"
    "{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- for c in message['content'] %}{%- if c['type'] == 'text' %}{{- c['text'] }}"
    "{%- elif c['type'] == 'image' %}{{- '[IMG]' }}{%- endif %}{%- endfor %}"
    "{{- '[/INST]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)


@dataclass
class TinyFlux2Options:
    """Sizes of the tiny FLUX.2 pipeline; the defaults give a transformer of about 76k parameters."""

    variant: Literal["klein-base", "klein", "dev"] = option(
        "klein-base",
        help="klein-base: Flux2KleinPipeline, classifier-free guidance against the empty prompt; "
        "klein: its step-distilled form (guidance ignored); dev: Flux2Pipeline (Mistral3 text "
        "encoder, embedded guidance)",
    )
    latent_size: int = option(8, ge=2, help="VAE latent height and width (even: FLUX.2 patchifies 2x2)")
    latent_channels: int = option(32, ge=1, help="VAE latent channels (FLUX.2: 32; the state has 4x as many)")
    vae_channels: list[int] = option(default_factory=lambda: [16, 32], ge=1, help="one downsampling per extra entry")
    num_layers: int = option(1, ge=1, help="double-stream (text and image) transformer blocks")
    num_single_layers: int = option(1, ge=0, help="single-stream transformer blocks")
    num_attention_heads: int = option(2, ge=1, help="attention heads")
    attention_head_dim: int = option(16, ge=1, help="channels per head")
    axes_dims_rope: list[int] = option(
        default_factory=lambda: [4, 4, 4, 4],
        ge=2,
        help="rotary channels per position axis (time, row, column, text "
        "position): even, summing to attention_head_dim",
    )
    text_hidden_size: int = option(
        16,
        ge=2,
        help="width of the text encoder (even: two heads; the prompt "
        "embedding is 3x as wide, one slice per tapped layer)",
    )
    words: list[str] = option(default_factory=lambda: list(DEFAULT_WORDS), help="whole-word tokens")
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if self.latent_size % 2:
            raise OptionError("latent_size", "must be even: FLUX.2 patchifies 2x2 latent patches")
        if len(self.axes_dims_rope) != 4 or any(d % 2 for d in self.axes_dims_rope):
            raise OptionError("axes_dims_rope", "give four even numbers (time, row, column, text position)")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise OptionError("axes_dims_rope", f"must sum to attention_head_dim={self.attention_head_dim}")
        if self.text_hidden_size % 2:
            raise OptionError("text_hidden_size", "must be even (two attention heads)")


def build_qwen3_tokenizer(words: list[str]):
    """Qwen's byte-level BPE tokenizer with Qwen3's thinking tokens and a chat template that honours
    ``enable_thinking=False`` (no download needed)."""
    from tokenizers import AddedToken

    tokenizer = build_qwen2_tokenizer(words)
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN3_THINKING_TOKENS], special_tokens=True
    )
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_pixtral_processor(words: list[str]):
    """FLUX.2 [dev]'s ``tokenizer`` component: a ``PixtralProcessor`` over a byte-level BPE tokenizer with
    Mistral's special tokens, whose words include those of the pipeline's system message (one token each, so
    the message that precedes every prompt stays ~30 tokens long instead of ~200 bytes)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken
    from transformers import PixtralImageProcessor, PixtralProcessor

    tokenizer = build_qwen2_tokenizer([*words, *re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)])
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIAL_TOKENS], special_tokens=True
    )
    # the vision tower is never run (text-to-image), but the processor needs an image side
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 32}, patch_size=8),
        tokenizer=tokenizer,
        patch_size=8,
        spatial_merge_size=1,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def _text_encoder(options: TinyFlux2Options, tokenizer):
    """Klein's Qwen3 causal LM or dev's Mistral3, each one layer deeper than its pipeline's last tapped layer."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    width = options.text_hidden_size
    text = dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=width // 2,
        max_position_embeddings=1024,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if options.variant != "dev":
        return Qwen3ForCausalLM(
            Qwen3Config(num_hidden_layers=KLEIN_OUT_LAYERS[-1] + 1, tie_word_embeddings=True, **text)
        )
    image_token = tokenizer.convert_tokens_to_ids("[IMG]")
    return Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config={
                "model_type": "mistral",
                "num_hidden_layers": DEV_OUT_LAYERS[-1] + 1,
                "rope_theta": 1e9,
                "sliding_window": None,
                **text,
            },
            vision_config={
                "model_type": "pixtral",
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "image_size": 32,
                "patch_size": 8,
                "head_dim": 8,
            },
            image_token_index=image_token,
            spatial_merge_size=1,
            vision_feature_layer=-1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


def build_tiny_flux2_pipeline(options: TinyFlux2Options):
    """Build the tiny pipeline deterministically from ``options.seed``, every part in eval mode."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )

    dev = options.variant == "dev"
    tokenizer = build_pixtral_processor(options.words) if dev else build_qwen3_tokenizer(options.words)
    out_layers = DEV_OUT_LAYERS if dev else KLEIN_OUT_LAYERS
    with torch.random.fork_rng(devices=[]):  # no CUDA devices: everything is built on the CPU
        torch.manual_seed(options.seed)
        text_encoder = _text_encoder(options, tokenizer.tokenizer if dev else tokenizer)
        vae = AutoencoderKLFlux2(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * len(options.vae_channels),
            up_block_types=("UpDecoderBlock2D",) * len(options.vae_channels),
            block_out_channels=tuple(options.vae_channels),
            layers_per_block=1,
            latent_channels=options.latent_channels,
            norm_num_groups=min(8, options.vae_channels[0]),
            sample_size=options.latent_size * 2 ** (len(options.vae_channels) - 1),
            patch_size=(2, 2),
        )
        # the latent statistics of the patchified latent, random (not 0 and 1) so that a decode which forgot
        # to undo the normalisation would show
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape))
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=4 * options.latent_channels,  # a token is a patchified 2x2 latent patch
            num_layers=options.num_layers,
            num_single_layers=options.num_single_layers,
            attention_head_dim=options.attention_head_dim,
            num_attention_heads=options.num_attention_heads,
            joint_attention_dim=len(out_layers) * options.text_hidden_size,  # the tapped layers, concatenated
            axes_dims_rope=tuple(options.axes_dims_rope),
            guidance_embeds=dev,
        )  # [dev] is guidance-distilled: guidance is an input; klein has none
    # built from configs every part is in training mode (the VAE's BatchNorm would update its statistics)
    for part in (text_encoder, vae, transformer):
        part.eval()
    parts = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    if dev:
        return Flux2Pipeline(**parts)
    return Flux2KleinPipeline(**parts, is_distilled=options.variant == "klein")
