"""Flow-matching text-to-image backbone on diffusers' ``QwenImagePipeline`` (Qwen-Image).

Loads a Qwen-Image pipeline folder or hub id (or builds a tiny one offline, :func:`build_tiny_qwen_image_pipeline`)
and trains its transformer (see :mod:`gyremedia.backbones.diffusers_pipeline` for what every diffusers flow backbone
shares). What is Qwen-Image's own:

- the state is the unpacked latent ``[C, h, w]``: ``randn`` of that shape draws the same numbers as the pipeline's
  ``prepare_latents`` (which draws ``[1, C, h, w]`` per generator, then packs), so ``pipe(generator=[...])``
  starts from our initial noise; the latent is packed into 2x2 patches ``[h/2 * w/2, 4C]`` only around the
  transformer;
- prompts have their own lengths: each is padded to ``max_sequence_length`` tokens, with a mask;
- guidance is true classifier-free guidance with a negative prompt, rescaled per packed token;
- the noise schedule shifts with the image's token count (dynamic shifting);
- the VAE is a video VAE (one frame) normalised by per-channel ``latents_mean`` / ``latents_std``.
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
from gyremedia.tiny.sd3 import DEFAULT_WORDS, _byte_alphabet, learn_merges

# Every linear layer of a block: both streams' attention and feed-forward (the AdaLN ``img_mod`` / ``txt_mod``
# are left out). The down-projections are ``*_mlp.net.2`` (a plain Linear), not ``net.2.proj``, which matches nothing.
LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]
PIPELINE_SEQUENCE_LENGTH = 512  # QwenImagePipeline.__call__'s default max_sequence_length

# ----------------------------------------------------------------------------- tiny pipeline

# Qwen2.5-VL's special tokens (the first is also its padding token)
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# The words of QwenImagePipeline's prompt template. One token each, its system prefix tokenizes into exactly the
# pipeline's prompt_template_encode_start_idx (34) tokens, as with Qwen's real tokenizer: the pipeline drops that
# many hidden states, so any other count would cut the prompt or keep part of the template.
TEMPLATE_WORDS = (
    "system user assistant Describe the image by detailing color shape size texture quantity text "
    "spatial relationships of objects and background"
).split()


@dataclass
class TinyQwenImageOptions:
    """Sizes of the tiny pipeline; the defaults give about 270k parameters (190k in the transformer)."""

    latent_size: int = option(8, ge=2, help="latent height and width (even: the transformer packs 2x2 patches)")
    latent_channels: int = option(4, ge=1, help="latent channels (the VAE's z_dim)")
    vae_channels: int = option(4, ge=1, help="the VAE's base width")
    vae_multipliers: list[int] = option(
        default_factory=lambda: [1, 2], ge=1, help="the VAE's width multipliers, one 2x downsampling per extra entry"
    )
    num_layers: int = option(2, ge=1, help="transformer blocks")
    num_attention_heads: int = option(3, ge=1, help="attention heads")
    attention_head_dim: int = option(16, ge=8, help="channels per head (a multiple of 8: split over 3 RoPE axes)")
    text_hidden_size: int = option(16, ge=16, help="width of the Qwen2.5-VL text encoder (a multiple of 16)")
    text_layers: int = option(2, ge=1, help="layers of the text encoder")
    max_sequence_length: int = option(16, ge=1, le=1024, help="the backbone's max_sequence_length when it is None")
    words: list[str] = option(default_factory=lambda: list(DEFAULT_WORDS), help="whole-word tokens")
    seed: int = option(0, ge=0, help="seed of the random weights")

    def validate(self) -> None:
        if self.latent_size % 2:
            raise OptionError("latent_size", "must be even (2x2 patches)")
        if self.attention_head_dim % 8:
            raise OptionError("attention_head_dim", "must be a multiple of 8")
        if self.text_hidden_size % 16:
            raise OptionError("text_hidden_size", "must be a multiple of 16")


def _byte_chars() -> dict[int, str]:
    """tiny_sd3's byte alphabet as a byte -> character map: printable bytes stand for themselves, the others
    take the extra characters in byte order (space 'Ġ', newline 'Ċ'), as in GPT-2 and Qwen."""
    alphabet = _byte_alphabet()
    printable = [ord(c) for c in alphabet if ord(c) < 256]
    others = [b for b in range(256) if b not in set(printable)]
    return dict(zip(printable + others, alphabet))


def build_qwen2_tokenizer(words: list[str]):
    """A byte-level BPE ``Qwen2Tokenizer`` with one token per listed word and per template word, bare and after
    a space (Qwen's pre-tokenizer keeps the space on the word: ' red' -> 'Ġred'), and Qwen's special tokens."""
    from transformers import Qwen2Tokenizer

    chars = _byte_chars()
    alphabet = _byte_alphabet()
    vocab = {c: i for i, c in enumerate(alphabet)}
    encoded = sorted(
        {"".join(chars[b] for b in (prefix + w).encode()) for w in [*words, *TEMPLATE_WORDS] for prefix in ("", " ")}
    )
    merges = learn_merges([w for w in encoded if len(w) > 1], end_of_word="")
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


def build_tiny_qwen_image_pipeline(options: TinyQwenImageOptions):
    """Build the tiny pipeline deterministically from ``options.seed`` (every part in eval mode)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_qwen2_tokenizer(options.words)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text, head = options.text_hidden_size, options.attention_head_dim
    # each of the text encoder's 2 heads has text/2 channels; M-RoPE splits their text/4 frequencies over
    # (time, height, width), in the proportions 1:1:2
    quarter = text // 16
    channels = options.latent_channels
    with torch.random.fork_rng(devices=[]):  # built on the CPU: no CUDA generator to fork
        torch.manual_seed(options.seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * channels,
            out_channels=channels,
            num_layers=options.num_layers,
            attention_head_dim=head,
            num_attention_heads=options.num_attention_heads,
            joint_attention_dim=text,
            guidance_embeds=False,
            axes_dims_rope=(head // 2, head // 4, head // 4),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=options.vae_channels,
            z_dim=channels,
            dim_mult=list(options.vae_multipliers),
            num_res_blocks=1,
            temperal_downsample=[False] * (len(options.vae_multipliers) - 1),
            # not 0 and 1, so that a decode which forgot the de-normalisation would show
            latents_mean=torch.linspace(-0.5, 0.5, channels).tolist(),
            latents_std=torch.linspace(0.5, 2.0, channels).tolist(),
        )
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": len(tokenizer),
                    "hidden_size": text,
                    "intermediate_size": 2 * text,
                    "num_hidden_layers": options.text_layers,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 2,
                    "max_position_embeddings": 2048,
                    "rope_theta": 1000000.0,
                    "rope_scaling": {
                        "mrope_section": [quarter, quarter, 2 * quarter],
                        "rope_type": "default",
                        "type": "default",
                    },
                    "bos_token_id": ids["<|endoftext|>"],
                    "eos_token_id": ids["<|im_end|>"],
                    "pad_token_id": ids["<|endoftext|>"],
                },
                # the vision tower is never run (text-to-image), but the class has one
                vision_config={
                    "depth": 1,
                    "hidden_size": 16,
                    "intermediate_size": 16,
                    "num_heads": 2,
                    "out_hidden_size": text,
                },
                image_token_id=ids["<|image_pad|>"],
                video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"],
                vision_end_token_id=ids["<|vision_end|>"],
            )
        )
    # Qwen/Qwen-Image's scheduler_config.json
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        invert_sigmas=False,
        max_image_seq_len=8192,
        max_shift=0.9,
        num_train_timesteps=1000,
        shift=1.0,
        shift_terminal=0.02,
        stochastic_sampling=False,
        time_shift_type="exponential",
        use_beta_sigmas=False,
        use_dynamic_shifting=True,
        use_exponential_sigmas=False,
        use_karras_sigmas=False,
    )
    for part in (transformer, vae, text_encoder):
        part.eval()
    return QwenImagePipeline(
        transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
    )


# ----------------------------------------------------------------------------- backbone


@dataclass
class QwenImageOptions(PipelineOptions):
    tiny: TinyQwenImageOptions = field(default_factory=TinyQwenImageOptions)
    # Every prompt is padded to this many tokens (its own and the template's last 5), with a mask, so that
    # conditions stack; the stock pipeline pads a batch to its longest prompt instead, which computes the same.
    max_sequence_length: int | None = option(
        None,
        ge=1,
        le=1024,
        help="text tokens per prompt (the pipeline's "
        "max_sequence_length); None: its default, 512 (the tiny model: "
        "tiny.max_sequence_length)",
    )
    # Qwen-Image's examples and QwenImagePipeline's docstring use " " when there is nothing to steer away from
    negative_prompt: str = option(" ", help="the negative prompt of true classifier-free guidance")
    height: int | None = option(
        None,
        ge=1,
        help="image height in pixels; None: the pipeline's default, 1024 (the tiny model: tiny.latent_size latents)",
    )
    width: int | None = option(None, ge=1, help="image width in pixels; None: as for height")
    lora: LoraOptions = field(default_factory=lambda: LoraOptions(target_modules=list(LORA_TARGETS)))


class QwenImageBackbone(DiffusersFlowPolicy):
    """A Qwen-Image pipeline seen as a policy over denoising transitions of its unpacked latent."""

    media_kind = "image"
    pipeline_class = "QwenImagePipeline"
    # The transformer takes sigma itself: the pipeline passes scheduler.timesteps / 1000, and the
    # transformer's timestep embedding multiplies by 1000 inside.
    timestep_scale = 1.0

    def __init__(self, options: QwenImageOptions, context: BuildContext) -> None:
        super().__init__(options, context)
        scale = self.pipeline.vae_scale_factor
        tiny = not options.pretrained
        default = options.tiny.latent_size * scale if tiny else self.pipeline.default_sample_size * scale
        self.height, self.width = options.height or default, options.width or default
        self.max_sequence_length = options.max_sequence_length or (
            options.tiny.max_sequence_length if tiny else PIPELINE_SEQUENCE_LENGTH
        )
        for name, size in (("height", self.height), ("width", self.width)):
            if size % (2 * scale):
                raise ValueError(
                    f"backbone.{name}={size} must be a multiple of {2 * scale} "
                    f"(the VAE's factor {scale} times the 2x2 packing)"
                )

    def build_tiny(self, options: QwenImageOptions):
        return build_tiny_qwen_image_pipeline(options.tiny)

    # ------------------------------------------------------------------ packing

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, h, w]`` -> ``[B, h/2 * w/2, 4C]``, the pipeline's own packing into 2x2 patches."""
        b, c, h, w = x.shape
        return self.pipeline._pack_latents(x, b, c, h, w)

    def _unpack(self, packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_pack`, to the shape of ``like`` (the pipeline's unpacking, which takes pixel
        sizes, without its frame axis)."""
        scale = self.pipeline.vae_scale_factor
        h, w = like.shape[-2:]
        return self.pipeline._unpack_latents(packed, h * scale, w * scale, scale)[:, :, 0]

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's embeddings, padded with zeros to ``max_sequence_length`` tokens, and the mask of its own."""
        length = self.max_sequence_length
        embeds, _ = self.pipeline.encode_prompt(prompt=[prompt], device=self.encoder_device, max_sequence_length=length)
        tokens = embeds.shape[1]  # the pipeline already cut the prompt to `length`
        padded = embeds.new_zeros(length, embeds.shape[2])
        padded[:tokens] = embeds[0]
        mask = torch.zeros(length, dtype=torch.long, device=self.encoder_device)
        mask[:tokens] = 1
        return {"prompt_embeds": padded, "prompt_embeds_mask": mask}

    def state_shape(self) -> tuple[int, ...]:
        scale = self.pipeline.vae_scale_factor
        return self.transformer.config.in_channels // 4, self.height // scale, self.width // scale

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        _, _, h, w = x.shape
        return {
            "hidden_states": self._pack(x),
            "timestep": timestep,
            "encoder_hidden_states": conditions["prompt_embeds"],
            "encoder_hidden_states_mask": conditions["prompt_embeds_mask"],
            "img_shapes": [[(1, h // 2, w // 2)]] * x.shape[0],
        }  # (frames, rows, columns) of patches

    def velocity(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._unpack(output, x)

    def guided(self, unconditional: torch.Tensor, conditional: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """QwenImagePipeline's true CFG: ``v_u + s (v_c - v_u)``, rescaled to the conditional prediction's norm
        per packed token (a 2x2 patch's 4C values), so it is computed in the packed layout."""
        negative, positive = self._pack(unconditional), self._pack(conditional)
        combined = negative + guidance_scale * (positive - negative)
        rescale = torch.norm(positive, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True)
        return self._unpack(combined * rescale, conditional)

    def timesteps_arguments(self, num_steps: int) -> dict[str, Any]:
        # (the scheduler then stretches the last sigma to its shift_terminal)
        _, h, w = self.state_shape()
        return self.resolution_shifted(num_steps, (h // 2) * (w // 2))

    def generation_arguments(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width, "max_sequence_length": self.max_sequence_length}

    def usage(self, out_dir: Path, adapters_only: bool) -> str:
        return super().usage(out_dir, adapters_only) + (
            "For Qwen-Image that guidance is `true_cfg_scale=<rollout.guidance_scale>` with "
            f"`negative_prompt={self.options.negative_prompt!r}` (the pipeline guides only given a negative prompt).\n"
        )

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        vae = self.pipeline.vae
        latents = final[:, :, None].to(vae.dtype)  # [B, C, 1, h, w]: one frame of the video VAE
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latents)
        images = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return Media("image", unit_range(images))


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "qwen_image",
        QwenImageBackbone,
        options=QwenImageOptions,
        description="Qwen-Image rectified-flow text-to-image (diffusers), full or LoRA",
    )
