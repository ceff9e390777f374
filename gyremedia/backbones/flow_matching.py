"""Flow-matching text-to-image backbone on diffusers' Stable Diffusion 3 family.

Loads a ``StableDiffusion3Pipeline`` folder or hub id (or builds a tiny one from a config), keeps the
text encoders and VAE frozen, and trains the transformer fully or through LoRA adapters.
Convention: ``x_sigma = (1 - sigma) x0 + sigma eps`` and the transformer predicts ``v = eps - x0``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from gyremedia import hookimpl
from gyremedia.backbones.denoising import DenoisingPolicy
from gyremedia.backbones.tiny_sd3 import TinySD3Options, build_tiny_sd3_pipeline
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy
from gyremedia.interfaces import BuildContext
from gyremedia.options import option, pretrained_source
from gyremedia.rollout import Media

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FlowMatchingOptions:
    pretrained: str | None = option(None, check=pretrained_source,
                                    help="StableDiffusion3Pipeline folder or hub id; None builds `tiny`")
    tiny: TinySD3Options = field(default_factory=TinySD3Options)
    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", help="weights of the frozen parts and "
                                                                              "the transformer")
    max_sequence_length: int = option(256, ge=1, help="T5 tokens (or zero padding when the pipeline has no T5)")
    lora: LoraOptions = field(default_factory=LoraOptions)
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")
    # ParetoSlider: a trainable linear map (zero at start, so the base model is unchanged) adds a
    # reward-preference weight vector of this length to the pooled text embedding; 0 = none.
    preference_inputs: int = option(0, ge=0, help="length of the reward-preference input (ParetoSlider); 0 = none")
    # Its output is multiplied by this: under Adam a parameter moves about lr per step whatever its
    # gradient's scale, so this is the embedder's learning-rate multiplier (the rest of the model
    # already responds to its prompt; the new input must catch up within the run).
    preference_scale: float = option(1000.0, gt=0, help="the preference embedder's learning-rate multiplier")


PREFERENCE_FILE = "preference_embedder.safetensors"
DIFFUSERS_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length


class FlowMatchingBackbone(TransformerPolicy, DenoisingPolicy):
    """An SD3-family pipeline seen as a policy over denoising transitions."""

    media_kind = "image"
    prediction = "velocity"

    def __init__(self, options: FlowMatchingOptions, context: BuildContext) -> None:
        from diffusers import StableDiffusion3Pipeline

        self.options = options
        self.device = context.device
        dtype = DTYPES[options.dtype]
        if options.pretrained:
            # A pipeline saved without T5 lists it as null, which diffusers loads only when told so.
            index = StableDiffusion3Pipeline.load_config(options.pretrained)
            absent = {name: None for name in ("text_encoder_3", "tokenizer_3") if index.get(name, [None])[0] is None}
            self.pipeline = StableDiffusion3Pipeline.from_pretrained(options.pretrained, dtype=dtype, **absent)
        else:
            self.pipeline = build_tiny_sd3_pipeline(options.tiny)
            if dtype != torch.float32:
                self.pipeline.to(dtype=dtype)
        self.pipeline.set_progress_bar_config(disable=True)
        self.pipeline.to(self.device)
        for part in (self.pipeline.vae, self.pipeline.text_encoder, self.pipeline.text_encoder_2,
                     self.pipeline.text_encoder_3):
            if part is not None:
                part.requires_grad_(False).eval()
        self.transformer = self.pipeline.transformer
        self.scheduler = self.pipeline.scheduler
        self._prepare_training(options.lora, options.gradient_checkpointing)
        self.preference_embedder: torch.nn.Linear | None = None
        if options.preference_inputs:
            self._add_preference_embedder(options.preference_inputs)
        self._prompt_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._negative: tuple[torch.Tensor, torch.Tensor] | None = None

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

    # ------------------------------------------------------------------ policy

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Prompt embeddings from the pipeline's own encoders, computed once per distinct prompt.

        Each prompt is encoded alone: a batched encoder's output can differ in its last bits with the
        batch it was computed in, and a resumed run (whose cache starts empty) must see the same numbers.
        """
        for prompt in dict.fromkeys(prompts):
            if prompt not in self._prompt_cache:
                embeds, pooled = self._encode([prompt])
                self._prompt_cache[prompt] = (embeds[0], pooled[0])
        return {
            "prompt_embeds": torch.stack([self._prompt_cache[p][0] for p in prompts]),
            "pooled_projections": torch.stack([self._prompt_cache[p][1] for p in prompts]),
        }

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.options.max_sequence_length,
        )
        return embeds, pooled

    def _negative_conditions(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._negative is None:
            self._negative = self._encode([""])
        embeds, pooled = self._negative
        return embeds.expand(batch, -1, -1), pooled.expand(batch, -1)

    def sample_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        config = self.transformer.config
        shape = (config.in_channels, config.sample_size, config.sample_size)
        noise = torch.stack([torch.randn(shape, generator=g) for g in generators])
        return noise.to(self.device, self.transformer.dtype)

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, conditions: dict[str, torch.Tensor],
                guidance_scale: float = 1.0, *, reference: bool = False) -> torch.Tensor:
        """``conditions["preference"]`` (``[B, preference_inputs]``), when present, conditions the policy
        (never the reference, which is the base model) on reward-preference weights."""
        embeds, pooled = conditions["prompt_embeds"], conditions["pooled_projections"]
        if "preference" in conditions and not reference:
            if self.preference_embedder is None:
                raise ValueError("preference weights given, but backbone.preference_inputs is 0")
            pooled = pooled + self.options.preference_scale * self.preference_embedder(conditions["preference"].to(pooled.dtype))
        if guidance_scale > 1.0:
            negative_embeds, negative_pooled = self._negative_conditions(x.shape[0])
            x_in = torch.cat([x, x])
            embeds = torch.cat([negative_embeds, embeds])
            pooled = torch.cat([negative_pooled, pooled])
        else:
            x_in = x
        # sigma: one noise level for the batch, or one per sample (forward-process objectives)
        timestep = (sigma * 1000).to(x.dtype).reshape(-1).expand(x.shape[0])
        if guidance_scale > 1.0:
            timestep = torch.cat([timestep, timestep])
        output = self._forward(reference, hidden_states=x_in, timestep=timestep, encoder_hidden_states=embeds,
                               pooled_projections=pooled)
        if guidance_scale > 1.0:
            uncond, cond = output.chunk(2)
            output = uncond + guidance_scale * (cond - uncond)
        return output

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        vae = self.pipeline.vae
        latents = final.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents, return_dict=False)[0]
        return Media("image", (images.float() / 2 + 0.5).clamp(0, 1))


    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """Write a ``StableDiffusion3Pipeline`` folder that diffusers loads without gyremedia.

        Under LoRA, ``merge_lora`` folds the adapters into a copy of the weights; otherwise only the
        adapters are written, in the format ``pipe.load_lora_weights(out_dir)`` reads. A preference
        embedder (ParetoSlider) goes beside them in ``PREFERENCE_FILE``.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "README.md").write_text(self._usage(out_dir, adapters_only=self.lora_enabled and not merge_lora))
        with self._preference_detached():
            self._save_pipeline(out_dir, merge_lora)

    @contextlib.contextmanager
    def _preference_detached(self):
        """Within the block the transformer lacks the preference embedder, so its saved weights are stock SD3's."""
        if self.preference_embedder is None:
            yield
            return
        del self.transformer.preference_embedder
        try:
            yield
        finally:
            self.transformer.add_module("preference_embedder", self.preference_embedder)

    def _save_pipeline(self, out_dir: Path, merge_lora: bool) -> None:
        from diffusers import StableDiffusion3Pipeline

        if self.preference_embedder is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in self.preference_embedder.state_dict().items()}, str(out_dir / PREFERENCE_FILE))
        if not self.lora_enabled:
            self.pipeline.save_pretrained(out_dir)
            return
        if not merge_lora:
            from peft import get_peft_model_state_dict

            config = self.transformer.peft_config["default"]
            StableDiffusion3Pipeline.save_lora_weights(
                out_dir, transformer_lora_layers=get_peft_model_state_dict(self.transformer),
                transformer_lora_adapter_metadata=config.to_dict())
            return
        components = {**self.pipeline.components, "transformer": self._merged_transformer()}
        StableDiffusion3Pipeline(**components).save_pretrained(out_dir)


    def _usage(self, out_dir: Path, adapters_only: bool) -> str:
        """How to load what :meth:`save_pretrained` wrote, with plain diffusers."""
        no_t5 = self.pipeline.text_encoder_3 is None
        base = self.options.pretrained or "BASE_PIPELINE_FOLDER"
        load = f'StableDiffusion3Pipeline.from_pretrained("{base if adapters_only else out_dir}"'
        load += ", text_encoder_3=None, tokenizer_3=None)" if no_t5 else ")"
        lines = ["# Trained with gyremedia", "", "```python", "from diffusers import StableDiffusion3Pipeline", "",
                 f"pipe = {load}"]
        if adapters_only:
            lines.append(f'pipe.load_lora_weights("{out_dir}")')
        trained_length = self.options.max_sequence_length
        call = 'image = pipe("a prompt"'
        call += f", max_sequence_length={trained_length})" if trained_length != DIFFUSERS_SEQUENCE_LENGTH else ")"
        lines += [call + ".images[0]", "```", ""]
        if no_t5:
            lines += ["This pipeline has no T5 encoder (diffusers' supported SD3 variant without it), so it is loaded",
                      "with `text_encoder_3=None, tokenizer_3=None`.", ""]
        if trained_length != DIFFUSERS_SEQUENCE_LENGTH:
            lines += [f"It was trained with {trained_length} T5 token(s) (`max_sequence_length={trained_length}`): "
                      "pass the same value when generating.", ""]
        if self.preference_embedder is not None:
            lines += [f"`{PREFERENCE_FILE}` holds the preference input (ParetoSlider) this model was trained with: "
                      "gyremedia loads it", f"with `backbone.pretrained=<this folder> backbone.preference_inputs="
                      f"{self.options.preference_inputs}`. Plain diffusers generates without it.", ""]
        return "\n".join(lines)


@hookimpl
def gyremedia_register_backbones(register):
    register("flow_matching", FlowMatchingBackbone, options=FlowMatchingOptions,
             description="SD3-family rectified-flow text-to-image (diffusers), full or LoRA")
