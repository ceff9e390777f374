"""Diffusion text-to-image backbones on diffusers' Stable Diffusion 1.x/2.x and SDXL pipelines (UNet, epsilon or v).

``diffusion`` loads a ``StableDiffusionPipeline`` folder or hub id, ``diffusion_xl`` a
``StableDiffusionXLPipeline`` one (or each builds its tiny replica of :mod:`gyremedia.tiny.sd`), and
trains its ``UNet2DConditionModel``, full or LoRA (adapters on the attention projections ``to_q``, ``to_k``,
``to_v``, ``to_out.0``); the CLIP text encoders and the VAE stay frozen. SDXL's extra conditioning is the
stock pipeline's: the second encoder's pooled embedding and the six size numbers ``(original size, crop
top-left, target size)``, here the trained resolution without crop, and zeros as the unconditional branch
of guidance for an empty negative prompt (``force_zeros_for_empty_prompt``). Everything else a diffusers
pipeline backbone shares (prompt cache, classifier-free guidance, the reference policy, checkpoints, export
to the stock pipeline) is :mod:`gyremedia.backbones.diffusers_pipeline`'s.

Noise convention: the scheduler's variance-preserving forward process
``x = sqrt(alpha_bar) x0 + sqrt(1 - alpha_bar) eps`` (``scheduler.add_noise``), with the noise level reported
as ``sigma = sqrt(1 - alpha_bar)``: :meth:`DiffusionBackbone.sigmas` gives DDIM's levels for the stock
pipeline's timesteps, :meth:`DiffusionBackbone.predict` returns diffusers' ``v = sqrt(alpha_bar) eps - sigma x0``
(the ``ddim_eta`` sampler's input, defined at pure noise too) whatever the UNet predicts (``prediction_type``
of the scheduler's config: ``epsilon``, ``v_prediction`` or ``sample``), converted by :func:`split_prediction`.
The UNet is evaluated at the fractional timestep whose ``sigma`` that is (linear between the scheduler's
table entries; exact at them).

The forward-process objectives (nft, awm, vgrpo, pairwise) train on the flow path ``x_t = (1 - t) x0 + t eps``;
:meth:`DiffusionBackbone.flow_velocity` converts exactly. A flow state is a scaled VP state with the same
signal-to-noise ratio: with ``c = 1 / sqrt((1 - t)^2 + t^2)``,

    c x_t = sqrt(alpha_bar) x0 + sigma eps,   sqrt(alpha_bar) = c (1 - t),   sigma = c t

so the UNet sees ``c x_t`` at level ``sigma = c t``, its output gives ``eps`` and ``x0`` (:func:`split_prediction`),
and the velocity is ``v = eps - x0``. Conversely ``t = sigma / (sigma + sqrt(alpha_bar))``. Two limits: the
UNet was trained for ``alpha_bar >= alphas_cumprod[-1]`` only (``t <= 0.936`` for Stable Diffusion's schedule;
above it the UNet is evaluated at its last timestep), and an epsilon model's ``x0 = (x - sigma eps) /
sqrt(alpha_bar)`` amplifies its error by ``1 / (1 - t)`` near ``t = 1`` (relative to a velocity model, the
forward-process losses weight its high-noise levels more): with such a model keep the objective's ``t_max`` at or
below 0.93. A v-prediction model with a zero-terminal-SNR schedule (``assets/shapes16_sd``, the quickstart's) is
defined on all of ``[0, 1]``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from gyremedia import hookimpl
from gyremedia.backbones.diffusers_pipeline import DiffusersFlowPolicy, PipelineOptions
from gyremedia.interfaces import BuildContext
from gyremedia.sampling import per_sample
from gyremedia.tiny.sd import TinySDOptions, TinySDXLOptions, build_tiny_sd_pipeline

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")


@dataclass
class DiffusionOptions(PipelineOptions):
    """The pipeline options (``max_sequence_length`` is unused: Stable Diffusion pads prompts to its tokenizer's
    ``model_max_length``), and the sizes of the tiny pipeline built when ``pretrained`` is None."""

    tiny: TinySDOptions = field(default_factory=TinySDOptions)


def split_prediction(
    output: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, prediction_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise ``eps`` and the clean sample ``x0`` a VP model's ``output`` implies at states
    ``x = alpha x0 + sigma eps``, ``alpha = sqrt(1 - sigma^2)`` (``sigma`` a scalar or ``[B]``):

        epsilon       eps = output                 x0 = (x - sigma eps) / alpha
        v_prediction  eps = alpha v + sigma x      x0 = alpha x - sigma v      (v = alpha eps - sigma x0,
                                                                                diffusers' ``get_velocity``)
        sample        x0 = output                  eps = (x - alpha x0) / sigma

    The one the model predicts is returned as it is (no rounding), the other in fp32.
    """
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type {prediction_type!r}: expected one of {', '.join(PREDICTION_TYPES)}")
    x32, out32 = x.float(), output.float()
    sigma = per_sample(sigma.float().reshape(-1), x32)
    alpha = (1 - sigma**2).sqrt()
    if prediction_type == "epsilon":
        return output, (x32 - sigma * out32) / alpha
    if prediction_type == "v_prediction":
        return alpha * out32 + sigma * x32, alpha * x32 - sigma * out32
    return (x32 - alpha * out32) / sigma, output


def flow_to_vp(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For flow levels ``t`` the scale ``c = 1 / sqrt((1 - t)^2 + t^2)`` that maps ``x_t = (1 - t) x0 + t eps`` to
    the VP state ``c x_t = sqrt(1 - sigma^2) x0 + sigma eps``, and that state's ``sigma = c t``."""
    scale = ((1 - t) ** 2 + t**2).rsqrt()
    return scale, scale * t


class DiffusionBackbone(DiffusersFlowPolicy):
    """A Stable Diffusion 1.x/2.x pipeline seen as a policy over DDIM/DDPM transitions of its latent."""

    media_kind = "image"
    pipeline_class = "StableDiffusionPipeline"
    denoiser_component = "unet"
    prediction = "v_prediction"  # what predict() returns, whatever the UNet predicts (see split_prediction)

    def __init__(self, options: DiffusionOptions, context: BuildContext) -> None:
        super().__init__(options, context)
        config = self.scheduler.config
        if "alphas_cumprod" not in vars(self.scheduler) or config.get("prediction_type") not in PREDICTION_TYPES:
            raise ValueError(
                f"backbone diffusion needs a DDIM/DDPM-style scheduler (alphas_cumprod, prediction_type "
                f"in {', '.join(PREDICTION_TYPES)}); this pipeline has {type(self.scheduler).__name__}"
            )
        self.prediction_type = config.prediction_type
        # sigma of every training timestep, increasing with it: the table model_timestep inverts
        self._timestep_sigmas = (1 - self.scheduler.alphas_cumprod.float()).sqrt().to(self.device)

    def build_tiny(self, options: DiffusionOptions):
        return build_tiny_sd_pipeline(options.tiny)

    # ------------------------------------------------------------------ noise levels

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """``sqrt(1 - alpha_bar)`` at the stock pipeline's ``num_steps`` timesteps, then at the last step's target
        (DDIM's ``final_alpha_cumprod``: ``alphas_cumprod[0]`` for Stable Diffusion, so it ends just above 0; 1
        without one, as DDPM's step to ``t < 0``)."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps)
        final = torch.as_tensor(getattr(scheduler, "final_alpha_cumprod", 1.0), dtype=scheduler.alphas_cumprod.dtype)
        alpha_bars = torch.cat([scheduler.alphas_cumprod[scheduler.timesteps], final.reshape(1)])
        return (1 - alpha_bars).sqrt().float().to(self.device)

    def model_timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The (fractional) training timestep whose ``sqrt(1 - alpha_bar)`` is ``sigma``: linear between table
        entries, exactly the integer timestep at them, clamped to the trained range."""
        table = self._timestep_sigmas.to(sigma.device)
        sigma = sigma.float().reshape(-1).clamp(table[0], table[-1])
        upper = torch.searchsorted(table, sigma.contiguous()).clamp(1, len(table) - 1)
        low, high = table[upper - 1], table[upper]
        return (upper - 1).float() + (sigma - low) / (high - low)

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(
            [prompt], device=self.encoder_device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return {"prompt_embeds": embeds[0]}

    def state_shape(self) -> tuple[int, ...]:
        config = self.transformer.config
        return config.in_channels, config.sample_size, config.sample_size

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, torch.Tensor]:
        return {"sample": x, "timestep": timestep, "encoder_hidden_states": conditions["prompt_embeds"]}

    def generation_arguments(self) -> dict[str, int]:
        size = self.transformer.config.sample_size * self.pipeline.vae_scale_factor
        return {"height": size, "width": size}

    # ------------------------------------------------------------------ predictions

    def predict(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """``v = sqrt(alpha_bar) eps - sigma x0`` at VP states ``x`` of level ``sigma = sqrt(1 - alpha_bar)``
        (classifier-free guidance combines the UNet's outputs, as the stock pipeline does; the conversion to
        ``v`` is linear, so it commutes). A v-prediction UNet's output is returned as it is."""
        output = super().predict(x, sigma, conditions, guidance_scale, reference=reference)
        if self.prediction_type == "v_prediction":
            return output
        eps, x0 = split_prediction(output, x, sigma, self.prediction_type)
        sigma = per_sample(sigma.float().reshape(-1), eps)
        return (1 - sigma**2).sqrt() * eps.float() - sigma * x0.float()

    def flow_velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The velocity ``eps - x0`` at flow-path states ``x = (1 - t) x0 + t eps``: the UNet on the VP state
        ``c x`` at ``sigma = c t`` (:func:`flow_to_vp`, see the module docstring)."""
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1)
        scale, sigma = flow_to_vp(t)
        z = per_sample(scale, x) * x.float()
        z = z.to(x.dtype)
        output = super().predict(z, sigma, conditions, guidance_scale, reference=reference)
        eps, x0 = split_prediction(output, z, sigma, self.prediction_type)
        return eps.float() - x0.float()


@dataclass
class DiffusionXLOptions(PipelineOptions):
    """As :class:`DiffusionOptions`, with the tiny SDXL replica's sizes."""

    tiny: TinySDXLOptions = field(default_factory=TinySDXLOptions)


class DiffusionXLBackbone(DiffusionBackbone):
    """An SDXL pipeline: :class:`DiffusionBackbone` with two text encoders and pooled and size conditioning."""

    pipeline_class = "StableDiffusionXLPipeline"

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            [prompt], device=self.encoder_device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        return {"prompt_embeds": embeds[0], "text_embeds": pooled[0]}

    def negative_conditions(self, batch: int) -> dict[str, torch.Tensor]:
        """Zeros for an empty negative prompt when the pipeline says so, as the stock pipeline's call does."""
        conditions = super().negative_conditions(batch)
        if self.options.negative_prompt == "" and self.pipeline.config.get("force_zeros_for_empty_prompt", False):
            return {k: torch.zeros_like(v) for k, v in conditions.items()}
        return conditions

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, object]:
        size = self.generation_arguments()["height"]
        time_ids = torch.tensor([size, size, 0, 0, size, size], dtype=x.dtype, device=x.device).expand(x.shape[0], 6)
        return {
            **super().transformer_inputs(x, timestep, conditions, guidance_scale),
            "added_cond_kwargs": {"text_embeds": conditions["text_embeds"], "time_ids": time_ids},
        }


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "diffusion",
        DiffusionBackbone,
        options=DiffusionOptions,
        description="Stable Diffusion 1.x/2.x UNet text-to-image (diffusers; epsilon or v), full or LoRA",
    )
    register(
        "diffusion_xl",
        DiffusionXLBackbone,
        options=DiffusionXLOptions,
        description="SDXL UNet text-to-image (diffusers; two text encoders, pooled and size conditioning), "
        "full or LoRA",
    )
