"""Flow-matching text-to-image backbone on diffusers' FLUX.2: [klein] (base and step-distilled) and [dev].

Loads a ``Flux2KleinPipeline`` or ``Flux2Pipeline`` folder or hub id (the class its ``model_index.json``
names), or builds a tiny one (:mod:`gyremedia.tiny.flux2`), and trains its transformer (see
:mod:`gyremedia.backbones.diffusers_pipeline` for what every diffusers flow backbone shares). What is FLUX.2's own:

- The sampler's state is the *patchified, BatchNorm-normalised* latent ``[128, h/2, w/2]`` (4 x 32 VAE channels
  per 2x2 patch), what the pipelines' ``prepare_latents`` draws; the transformer sees it flattened to one token
  per position, with ``[B, L, 4]`` position ids rebuilt per call. ``decode`` undoes the normalisation with the
  VAE's ``bn`` running statistics, then unpatchifies.
- The transformer takes ``timestep = sigma`` (it scales by 1000 itself).
- ``guidance_scale`` depends on the model: klein base takes classifier-free guidance against the empty prompt
  when it is above 1 (two forwards); step-distilled klein ignores it; [dev] embeds it (guidance-distilled: one
  forward, 1.0 is a valid weak value, not "off").
- The schedule is ``linspace(1, 1/N, N)`` shifted by an empirical ``mu`` that depends on the image's token
  count *and* on the number of steps N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gyremedia import hookimpl
from gyremedia.backbones.diffusers_pipeline import DiffusersFlowPolicy, PipelineOptions, image_size, unit_range
from gyremedia.backbones.transformer_policy import LoraOptions
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option
from gyremedia.rollout import Media
from gyremedia.tiny.flux2 import TinyFlux2Options, build_tiny_flux2_pipeline

FLUX2_PIPELINES = ("Flux2KleinPipeline", "Flux2Pipeline")
# Single-stream blocks named by the default LoRA targets: FLUX.2 [dev]'s 48 (the transformer's default), the
# most of the released models (klein has fewer); a deeper fine-tune would need its extra names listed
MAX_SINGLE_BLOCKS = 48
# Flow-Factory's FLUX.2 targets: every attention projection and feed-forward of the double-stream blocks (image
# and text side) and the single-stream blocks' fused q/k/v + MLP input. The single-stream blocks' output
# projection ``attn.to_out`` (attention and MLP together) is added by full name: peft matches list entries as
# name suffixes, and "attn.to_out" would also hit the double-stream blocks' ``to_out`` ModuleList (an error).
FLUX2_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(MAX_SINGLE_BLOCKS)),
]
NO_NEGATIVE_PROMPT = "FLUX.2's pipelines take no negative prompt (klein's guidance is against the empty prompt)"


@dataclass
class Flux2Options(PipelineOptions):
    tiny: TinyFlux2Options = field(default_factory=TinyFlux2Options)
    lora: LoraOptions = field(default_factory=lambda: LoraOptions(target_modules=list(FLUX2_LORA_TARGETS)))
    negative_prompt: str = option(
        "",
        check=lambda value: NO_NEGATIVE_PROMPT if value else None,
        help="must stay empty: FLUX.2's pipelines guide against the empty prompt only",
    )
    height: int | None = option(
        None,
        ge=1,
        help="image height in pixels; None: the VAE's sample_size (FLUX.2: "
        "1024; the tiny model: its latent size times the VAE factor)",
    )
    width: int | None = option(None, ge=1, help="image width in pixels; None: as for height")


def folder_pipeline_class(pretrained: str) -> str:
    """The FLUX.2 pipeline class a folder or hub id holds (its ``model_index.json``'s ``_class_name``)."""
    from diffusers import DiffusionPipeline

    name = DiffusionPipeline.load_config(pretrained)["_class_name"]
    if name not in FLUX2_PIPELINES:
        raise OptionError(
            "pretrained", f"{pretrained} holds a {name}; the flux2 backbone loads {' or '.join(FLUX2_PIPELINES)}"
        )
    return name


class Flux2Backbone(DiffusersFlowPolicy):
    """A FLUX.2 pipeline ([klein] or [dev]) seen as a policy over denoising transitions of its normalised,
    patchified latent."""

    media_kind = "image"
    pipeline_class = "Flux2KleinPipeline"  # per instance: the folder's class, or the tiny variant's
    timestep_scale = 1.0  # Flux2Transformer2DModel multiplies its timestep (and guidance) input by 1000 itself

    def __init__(self, options: Flux2Options, context: BuildContext) -> None:
        # the base class loads and exports with stock_pipeline_class(), so the class is known before it runs
        if options.pretrained:
            self.pipeline_class = folder_pipeline_class(options.pretrained)
        else:
            self.pipeline_class = "Flux2Pipeline" if options.tiny.variant == "dev" else "Flux2KleinPipeline"
        super().__init__(options, context)
        factor = self.pipeline.vae_scale_factor
        self.height, self.width = image_size(self.pipeline, options.height, options.width, 2 * factor)
        # klein's step-distilled form skips classifier-free guidance whatever the scale (its config says so)
        self.distilled = bool(self.pipeline.config.get("is_distilled", False))

    def build_tiny(self, options: Flux2Options):
        return build_tiny_flux2_pipeline(options.tiny)

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        # the text position ids are rebuilt in transformer_inputs: not a condition
        embeds, _ = self.pipeline.encode_prompt(
            prompt=[prompt], device=self.encoder_device, max_sequence_length=self.options.max_sequence_length
        )
        return {"prompt_embeds": embeds[0]}

    def state_shape(self) -> tuple[int, ...]:
        # what prepare_latents draws: 4x the VAE's channels (one 2x2 patch each) at half its latent size
        patch = 2 * self.pipeline.vae_scale_factor
        return self.transformer.config.in_channels, self.height // patch, self.width // patch

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        pipeline = self.stock_pipeline_class()
        embeds = conditions["prompt_embeds"]
        # [dev]'s embedded guidance, one value per sample (fp32, as the pipeline makes it); klein has no input
        guidance = (
            torch.full([x.shape[0]], guidance_scale, device=x.device, dtype=torch.float32)
            if self.transformer.config.guidance_embeds
            else None
        )
        return {
            "hidden_states": pipeline._pack_latents(x),  # [B, C, h, w] -> [B, h*w, C]
            "timestep": timestep,
            "guidance": guidance,
            "encoder_hidden_states": embeds,
            # rotary position ids (time, row, column, text position) [B, L, 4]: (0, 0, 0, i) for text tokens,
            # (0, row, column, 0) for image tokens
            "txt_ids": pipeline._prepare_text_ids(embeds).to(x.device),
            "img_ids": pipeline._prepare_latent_ids(x).to(x.device),
        }

    def velocity(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # the inverse of _pack_latents (the pipelines scatter by position ids: the same row-major order)
        return output.transpose(1, 2).reshape(x.shape)

    def uses_cfg(self, guidance_scale: float) -> bool:
        # klein base: above 1 (the base class's rule); distilled klein and guidance-distilled [dev]: never
        if self.distilled or self.transformer.config.guidance_embeds:
            return False
        return super().uses_cfg(guidance_scale)

    def timesteps_arguments(self, num_steps: int) -> dict[str, Any]:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        _, rows, columns = self.state_shape()
        # FLUX.2's shift, fitted on token count and step count (FLUX.1's calculate_shift uses the former only)
        return {
            "sigmas": np.linspace(1.0, 1 / num_steps, num_steps),
            "mu": compute_empirical_mu(image_seq_len=rows * columns, num_steps=num_steps),
        }

    def generation_arguments(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, **super().generation_arguments()}

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        """Images in [0, 1]: un-normalise with the VAE's BatchNorm statistics, unpatchify, decode."""
        vae = self.pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        latents = self.stock_pipeline_class()._unpatchify_latents(final.to(vae.dtype) * std + mean)
        images = vae.decode(latents, return_dict=False)[0]
        return Media("image", unit_range(images))


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "flux2",
        Flux2Backbone,
        options=Flux2Options,
        description="FLUX.2 [klein] (base or distilled) and [dev] rectified-flow text-to-image (diffusers "
        "Flux2KleinPipeline, Flux2Pipeline), full or LoRA",
    )
