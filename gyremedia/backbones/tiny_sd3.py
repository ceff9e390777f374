"""A tiny, randomly initialised ``StableDiffusion3Pipeline`` built offline from configs.

Made of the stock diffusers/transformers parts (SD3 transformer, two CLIP text encoders with a
tokenizer whose vocabulary is built here, an AutoencoderKL), so everything trained on it exports
to a folder that ``StableDiffusion3Pipeline.from_pretrained`` loads without gyremedia.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyremedia.options import OptionError, option

DEFAULT_WORDS = (
    "a an one two three of the left right above below red green blue yellow white black "
    "circle circles square squares triangle triangles photo image"
).split()


@dataclass
class TinySD3Options:
    """Sizes of the tiny pipeline; the defaults give about half a million parameters."""

    latent_size: int = option(8, ge=1, help="latent height and width")
    latent_channels: int = option(4, ge=1, help="latent channels")
    vae_channels: list[int] = option(default_factory=lambda: [16, 32], ge=1, help="one downsampling per extra entry")
    patch_size: int = option(2, ge=1, help="transformer patch size")
    num_layers: int = option(2, ge=1, help="transformer blocks")
    num_attention_heads: int = option(2, ge=1, help="attention heads")
    attention_head_dim: int = option(16, ge=1, help="channels per head")
    text_hidden_size: int = option(32, ge=1, help="width of the CLIP text encoders")
    text_layers: int = option(2, ge=1, help="layers of the CLIP text encoders")
    text_max_length: int = option(16, ge=1, help="tokens per prompt")
    words: list[str] = option(default_factory=lambda: list(DEFAULT_WORDS), help="whole-word tokens")
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if self.latent_size % self.patch_size:
            raise OptionError("latent_size", f"must be a multiple of patch_size={self.patch_size}")


def _byte_alphabet() -> list[str]:
    """GPT-2/CLIP byte-level BPE alphabet: one printable character per byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def _learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """BPE merges learned on ``words`` until each is a single token.

    Learned as BPE training does (most frequent pair first, every word at once), so encoding
    replays the same merges and each listed word always becomes exactly one token.
    """
    segmented = [list(word[:-1]) + [word[-1] + "</w>"] for word in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for pieces in segmented:
            for pair in zip(pieces, pieces[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        for i, pieces in enumerate(segmented):
            merged, j = [], 0
            while j < len(pieces):
                if j + 1 < len(pieces) and (pieces[j], pieces[j + 1]) == best:
                    merged.append(pieces[j] + pieces[j + 1])
                    j += 2
                else:
                    merged.append(pieces[j])
                    j += 1
            segmented[i] = merged


def build_clip_tokenizer(words: list[str], max_length: int):
    """A CLIP tokenizer over bytes plus one token per listed word (no download needed)."""
    from transformers import CLIPTokenizer

    alphabet = _byte_alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)})
    merges = _learn_merges(sorted({w.lower() for w in words}))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def build_tiny_sd3_pipeline(options: TinySD3Options):
    """Build the tiny pipeline deterministically from ``options.seed``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    devices = []  # fork_rng needs no CUDA devices: everything is built on the CPU
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(options.seed)
        tokenizer = build_clip_tokenizer(options.words, options.text_max_length)
        text_config = CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=options.text_hidden_size,
            intermediate_size=options.text_hidden_size * 2,
            projection_dim=options.text_hidden_size,
            num_attention_heads=2,
            num_hidden_layers=options.text_layers,
            max_position_embeddings=options.text_max_length,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        text_encoder = CLIPTextModelWithProjection(text_config)
        text_encoder_2 = CLIPTextModelWithProjection(text_config)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * len(options.vae_channels),
            up_block_types=["UpDecoderBlock2D"] * len(options.vae_channels),
            block_out_channels=list(options.vae_channels),
            latent_channels=options.latent_channels,
            layers_per_block=1,
            norm_num_groups=min(8, options.vae_channels[0]),
            sample_size=options.latent_size * 2 ** (len(options.vae_channels) - 1),
            shift_factor=0.0,
            scaling_factor=1.0,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        transformer = SD3Transformer2DModel(
            sample_size=options.latent_size,
            patch_size=options.patch_size,
            in_channels=options.latent_channels,
            out_channels=options.latent_channels,
            num_layers=options.num_layers,
            attention_head_dim=options.attention_head_dim,
            num_attention_heads=options.num_attention_heads,
            joint_attention_dim=2 * options.text_hidden_size,
            caption_projection_dim=options.attention_head_dim * options.num_attention_heads,
            pooled_projection_dim=2 * options.text_hidden_size,
            pos_embed_max_size=options.latent_size // options.patch_size,
            qk_norm="rms_norm",
        )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
