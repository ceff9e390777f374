"""Flow-matching text-to-image backbone on diffusers' Stable Diffusion 3 family (SD3, SD3.5).

Loads a ``StableDiffusion3Pipeline`` folder or hub id (or builds a tiny one from a config) and trains its
transformer (see :mod:`gyremedia.backbones.diffusers_pipeline` for what every diffusers flow backbone shares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyremedia import hookimpl
from gyremedia.backbones.diffusers_pipeline import DiffusersFlowPolicy, PipelineOptions, image_size
from gyremedia.interfaces import BuildContext
from gyremedia.options import option
from gyremedia.tiny.sd3 import TinySD3Options, build_tiny_sd3_pipeline


@dataclass
class FlowMatchingOptions(PipelineOptions):
    tiny: TinySD3Options = field(default_factory=TinySD3Options)
    height: int | None = option(
        None,
        ge=1,
        help="image height in pixels; None: the transformer's sample_size times "
        "the VAE factor (SD3.5: 1024; Flow-GRPO trains SD3.5-M at 512)",
    )
    width: int | None = option(None, ge=1, help="image width in pixels; None: as for height")
    # ParetoSlider: a trainable linear map (zero at start, so the base model is unchanged) adds a
    # reward-preference weight vector of this length to the pooled text embedding; 0 = none.
    preference_inputs: int = option(0, ge=0, help="length of the reward-preference input (ParetoSlider); 0 = none")
    # Its output is multiplied by this: under Adam a parameter moves about lr per step whatever its
    # gradient's scale, so this is the embedder's learning-rate multiplier (the rest of the model
    # already responds to its prompt; the new input must catch up within the run).
    preference_scale: float = option(1000.0, gt=0, help="the preference embedder's learning-rate multiplier")


PREFERENCE_FILE = "preference_embedder.safetensors"
DIFFUSERS_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length


class FlowMatchingBackbone(DiffusersFlowPolicy):
    """An SD3-family pipeline seen as a policy over denoising transitions."""

    media_kind = "image"
    pipeline_class = "StableDiffusion3Pipeline"

    def __init__(self, options: FlowMatchingOptions, context: BuildContext) -> None:
        super().__init__(options, context)
        factor, config = self.pipeline.vae_scale_factor, self.transformer.config
        self.height, self.width = image_size(
            self.pipeline,
            options.height,
            options.width,
            factor * config.patch_size,
            default=config.sample_size * factor,
        )
        self.preference_embedder: torch.nn.Linear | None = None
        if options.preference_inputs:
            self._add_preference_embedder(options.preference_inputs)

    def build_tiny(self, options: FlowMatchingOptions):
        return build_tiny_sd3_pipeline(options.tiny)

    def _add_preference_embedder(self, inputs: int) -> None:
        """A zero-initialised ``Linear(inputs, pooled_dim)``, a submodule of the transformer so it trains and
        checkpoints with it; loaded from the pretrained folder when one saved it."""
        dim = self.transformer.config.pooled_projection_dim
        embedder = torch.nn.Linear(inputs, dim).to(self.device)
        torch.nn.init.zeros_(embedder.weight)
        torch.nn.init.zeros_(embedder.bias)
        saved = Path(self.options.pretrained or "") / PREFERENCE_FILE
        if self.options.pretrained and saved.is_file():
            from safetensors.torch import load_file

            embedder.load_state_dict(load_file(str(saved), device=str(self.device)))
        self.transformer.add_module("preference_embedder", embedder)
        self.preference_embedder = embedder

    def _extra_trainable(self) -> dict[str, torch.nn.Module]:
        return {"preference_embedder": self.preference_embedder} if self.preference_embedder is not None else {}

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=[prompt],
            prompt_2=None,
            prompt_3=None,
            device=self.encoder_device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.options.max_sequence_length,
        )
        return {"prompt_embeds": embeds[0], "pooled_projections": pooled[0]}

    def state_shape(self) -> tuple[int, ...]:
        factor = self.pipeline.vae_scale_factor
        return self.transformer.config.in_channels, self.height // factor, self.width // factor

    def extra_conditions(self, conditions: dict[str, torch.Tensor], reference: bool) -> dict[str, torch.Tensor]:
        """The preference input (ParetoSlider) added to the pooled embedding; the reference never sees it."""
        if "preference" not in conditions or reference:
            return {}
        if self.preference_embedder is None:
            raise ValueError("preference weights given, but backbone.preference_inputs is 0")
        pooled = conditions["pooled_projections"]
        preference = self.preference_embedder(conditions["preference"].to(pooled.dtype))
        return {"pooled_projections": pooled + self.options.preference_scale * preference}

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, torch.Tensor]:
        return {
            "hidden_states": x,
            "timestep": timestep,
            "encoder_hidden_states": conditions["prompt_embeds"],
            "pooled_projections": conditions["pooled_projections"],
        }

    def generation_arguments(self) -> dict[str, int]:
        arguments = {"height": self.height, "width": self.width}
        if self.options.max_sequence_length != DIFFUSERS_SEQUENCE_LENGTH:
            arguments["max_sequence_length"] = self.options.max_sequence_length
        return arguments

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """The stock ``StableDiffusion3Pipeline`` folder; a preference embedder (ParetoSlider) goes beside it in
        ``PREFERENCE_FILE``, outside the transformer, so its weights stay stock SD3's."""
        out_dir = Path(out_dir)
        if self.preference_embedder is None:
            super().save_pretrained(out_dir, merge_lora=merge_lora)
            return
        from safetensors.torch import save_file

        del self.transformer.preference_embedder
        try:
            super().save_pretrained(out_dir, merge_lora=merge_lora)
        finally:
            self.transformer.add_module("preference_embedder", self.preference_embedder)
        save_file(
            {k: v.contiguous() for k, v in self.preference_embedder.state_dict().items()},
            str(out_dir / PREFERENCE_FILE),
        )

    def usage(self, out_dir: Path, adapters_only: bool) -> str:
        text = super().usage(out_dir, adapters_only)
        if self.preference_embedder is not None:
            text += (
                f"`{PREFERENCE_FILE}` holds the preference input (ParetoSlider) this model was trained with: "
                f"gyremedia loads it\nwith `backbone.pretrained=<this folder> backbone.preference_inputs="
                f"{self.options.preference_inputs}`. Plain diffusers generates without it.\n"
            )
        return text


@hookimpl
def gyremedia_register_backbones(register):
    register(
        "flow_matching",
        FlowMatchingBackbone,
        options=FlowMatchingOptions,
        description="SD3-family rectified-flow text-to-image (diffusers), full or LoRA",
    )
