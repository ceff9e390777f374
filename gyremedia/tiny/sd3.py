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
    t5: bool = option(True, help="include SD3's third encoder, a T5 whose final norm is zero (see build_silent_t5)")
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if self.latent_size % self.patch_size:
            raise OptionError("latent_size", f"must be a multiple of patch_size={self.patch_size}")


def _byte_alphabet() -> list[str]:
    """GPT-2/CLIP byte-level BPE alphabet: one printable character per byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def learn_merges(words: list[str], end_of_word: str = "</w>") -> list[tuple[str, str]]:
    """BPE merges learned on ``words`` until each is a single token.

    Learned as BPE training does (most frequent pair first, every word at once), so encoding
    replays the same merges and each listed word always becomes exactly one token. ``end_of_word`` is the
    suffix CLIP's BPE marks a word's last piece with ("" for a byte-level BPE such as Qwen's).
    """
    segmented = [list(word[:-1]) + [word[-1] + end_of_word] for word in words]
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
    merges = learn_merges(sorted({w.lower() for w in words}))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def build_t5_tokenizer(words: list[str], max_length: int):
    """A T5 (unigram, SentencePiece-style) tokenizer with one token per listed word (no download needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [
        (f"▁{w}", -1.0) for w in sorted({w.lower() for w in words})
    ]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=max_length,
    )


def build_silent_t5(words: list[str], width: int, max_length: int):
    """SD3's third text encoder, a one-layer T5 of ``width`` channels whose final layer norm is zero.

    Its output is exactly zero: what SD3's pipeline feeds the transformer when it has no T5, so a model
    pretrained without one keeps its behaviour, and the pipeline folder is complete: diffusers'
    ``StableDiffusion3Pipeline.from_pretrained(folder)`` loads it with no other argument.
    """
    from transformers import T5Config, T5EncoderModel

    tokenizer = build_t5_tokenizer(words, max_length)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=width,
        d_kv=8,
        d_ff=width,
        num_layers=1,
        num_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    encoder = T5EncoderModel(config)
    torch.nn.init.zeros_(encoder.encoder.final_layer_norm.weight)
    return encoder, tokenizer


def build_tiny_vae(vae_channels: list[int], latent_channels: int, latent_size: int, **config):
    """A stock ``AutoencoderKL`` of ``len(vae_channels)`` levels (one halving per extra level) whose latents are
    ``latent_size`` wide, without quant convs; ``config`` adds e.g. its ``scaling_factor`` and ``shift_factor``."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * len(vae_channels),
        up_block_types=["UpDecoderBlock2D"] * len(vae_channels),
        block_out_channels=list(vae_channels),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=min(8, vae_channels[0]),
        sample_size=latent_size * 2 ** (len(vae_channels) - 1),
        use_quant_conv=False,
        use_post_quant_conv=False,
        **config,
    )


def build_tiny_sd3_pipeline(options: TinySD3Options):
    """Build the tiny pipeline deterministically from ``options.seed``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
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
        vae = build_tiny_vae(
            options.vae_channels, options.latent_channels, options.latent_size, shift_factor=0.0, scaling_factor=1.0
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
        # built last, so it draws no random number the other parts would have drawn
        text_encoder_3, tokenizer_3 = (
            build_silent_t5(options.words, 2 * options.text_hidden_size, options.text_max_length)
            if options.t5
            else (None, None)
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
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def add_silent_t5(folder: str, words: list[str], seed: int = 0) -> None:
    """Give a tiny SD3 pipeline folder saved without T5 the silent one (:func:`build_silent_t5`), in place.

    Nothing the folder generates changes: its transformer saw zeros where T5's tokens go, and still does.
    """
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder, tokenizer = build_silent_t5(
            words, pipeline.transformer.config.joint_attention_dim, pipeline.tokenizer.model_max_length
        )
    pipeline.register_modules(text_encoder_3=encoder, tokenizer_3=tokenizer)
    pipeline.save_pretrained(folder)
