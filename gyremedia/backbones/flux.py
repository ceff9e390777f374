"""Flow-matching text-to-image backbone on diffusers' FLUX.1 (dev, schnell and their fine-tunes).

Loads a ``FluxPipeline`` folder or hub id (or builds a tiny one, :mod:`gyremedia.tiny.flux`) and
trains its transformer (see :mod:`gyremedia.backbones.diffusers_pipeline` for what every diffusers flow backbone
shares). What is FLUX's own:

- The sampler's state is the VAE latent ``[16, h, w]`` as the pipeline draws its noise; the transformer sees
  it packed, one token per 2x2 latent patch (``[h/2 * w/2, 64]``), with batch-free position ids rebuilt per call.
- The transformer takes ``timestep = sigma`` (it scales by 1000 itself).
- ``guidance_scale`` is FLUX.1-dev's *embedded* guidance: a distilled input (one forward per step, 1.0 is
  a valid weak value, not "off"). Models without that input (schnell) ignore it. Real classifier-free
  guidance against ``negative_prompt`` is the separate ``true_cfg_scale`` (two forwards per step).
- The schedule is ``linspace(1, 1/N, N)`` shifted by ``mu``, which grows with the image's token count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.backbones.diffusers_pipeline import DiffusersFlowPolicy, PipelineOptions, image_size
from gyremedia.backbones.transformer_policy import LoraOptions
from gyremedia.interfaces import BuildContext
from gyremedia.options import option
from gyremedia.tiny.flux import TinyFluxOptions, build_tiny_flux_pipeline

# The usual FLUX.1 LoRA targets (fal's trainer, Flow-Factory): every attention projection of the double-stream
# blocks (image and text side), their feed-forwards, and the single-stream blocks' q/k/v (``attn.to_*``).
FLUX_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]


@dataclass
class FluxOptions(PipelineOptions):
    tiny: TinyFluxOptions = field(default_factory=TinyFluxOptions)
    lora: LoraOptions = field(default_factory=lambda: LoraOptions(target_modules=list(FLUX_LORA_TARGETS)))
    height: int | None = option(
        None,
        ge=1,
        help="image height in pixels; None: the VAE's sample_size (FLUX.1: "
        "1024; the tiny model: its latent size times the VAE factor)",
    )
    width: int | None = option(None, ge=1, help="image width in pixels; None: as for height")
    true_cfg_scale: float = option(
        1.0,
        ge=1.0,
        help="FLUX's true classifier-free guidance against negative_prompt (two forwards per step); 1 = off",
    )


class FluxBackbone(DiffusersFlowPolicy):
    """A FLUX.1 pipeline seen as a policy over denoising transitions of its (unpacked) latent."""

    media_kind = "image"
    pipeline_class = "FluxPipeline"
    timestep_scale = 1.0  # FluxTransformer2DModel multiplies its timestep (and guidance) input by 1000 itself

    def __init__(self, options: FluxOptions, context: BuildContext) -> None:
        super().__init__(options, context)
        factor = self.pipeline.vae_scale_factor
        self.height, self.width = image_size(self.pipeline, options.height, options.width, 2 * factor)

    def build_tiny(self, options: FluxOptions):
        return build_tiny_flux_pipeline(options.tiny)

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        # the pipeline's text ids are batch-free zeros: rebuilt in transformer_inputs, not a condition
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=[prompt],
            prompt_2=None,
            device=self.encoder_device,
            max_sequence_length=self.options.max_sequence_length,
        )
        return {"prompt_embeds": embeds[0], "pooled_prompt_embeds": pooled[0]}

    def state_shape(self) -> tuple[int, ...]:
        # what FluxPipeline.prepare_latents draws its noise in, before packing
        factor = self.pipeline.vae_scale_factor
        return self.transformer.config.in_channels // 4, self.height // factor, self.width // factor

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        batch, channels, height, width = x.shape
        pipeline = self.stock_pipeline_class()
        embeds = conditions["prompt_embeds"]
        # embedded guidance, one value per sample (fp32, as the pipeline makes it); None without the input
        guidance = (
            torch.full([batch], guidance_scale, device=x.device, dtype=torch.float32)
            if self.transformer.config.guidance_embeds
            else None
        )
        return {
            "hidden_states": pipeline._pack_latents(x, batch, channels, height, width),
            "timestep": timestep,
            "guidance": guidance,
            "encoder_hidden_states": embeds,
            "pooled_projections": conditions["pooled_prompt_embeds"],
            # rotary position ids [tokens, 3], shared by the batch: zeros for text, (0, row, column) for image
            "txt_ids": torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype),
            "img_ids": pipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x.device, x.dtype),
        }

    def velocity(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        factor = self.pipeline.vae_scale_factor
        height, width = x.shape[-2:]  # _unpack_latents takes the size in pixels
        return self.stock_pipeline_class()._unpack_latents(output, height * factor, width * factor, factor)

    def uses_cfg(self, guidance_scale: float) -> bool:
        # guidance_scale is the embedded guidance (or ignored): only true CFG takes a second prediction
        return self.options.true_cfg_scale > 1.0

    def guided(self, unconditional: torch.Tensor, conditional: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        return super().guided(unconditional, conditional, self.options.true_cfg_scale)

    def timesteps_arguments(self, num_steps: int) -> dict[str, Any]:
        factor = self.pipeline.vae_scale_factor
        return self.resolution_shifted(num_steps, (self.height // factor // 2) * (self.width // factor // 2))

    def generation_arguments(self) -> dict[str, Any]:
        arguments = {"height": self.height, "width": self.width, **super().generation_arguments()}
        if self.options.true_cfg_scale > 1.0:  # the pipeline's true CFG runs only given a negative prompt
            arguments |= {
                "true_cfg_scale": self.options.true_cfg_scale,
                "negative_prompt": self.options.negative_prompt,
            }
        return arguments


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "flux",
        FluxBackbone,
        options=FluxOptions,
        description="FLUX.1 rectified-flow text-to-image (diffusers FluxPipeline), full or LoRA",
    )
