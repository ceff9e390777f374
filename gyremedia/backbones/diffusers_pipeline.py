"""What every flow-matching backbone on a stock diffusers pipeline shares (SD3, FLUX, Wan, Qwen-Image).

The pipeline's text encoders and VAE stay frozen; its transformer is the policy (full or LoRA, see
:mod:`gyremedia.backbones.transformer_policy`). Convention: ``x_sigma = (1 - sigma) x0 + sigma eps``; the
transformer predicts ``v = eps - x0``. A subclass names its pipeline class and supplies what differs between
architectures: how one prompt is encoded, the state's shape, the transformer's inputs (packing, position ids,
guidance embedding), how two predictions combine under classifier-free guidance, and how a state decodes.

A pipeline whose denoiser is not called ``transformer`` (Stable Diffusion's ``unet``) names it in
``denoiser_component``: it is still held as ``self.transformer``, the one network the shared training code
(:class:`~gyremedia.backbones.transformer_policy.TransformerPolicy`) trains, and it goes back under its own
name into exports. A backbone on another forward process (variance-preserving diffusion) maps the noise
level to the network's timestep in :meth:`DiffusersFlowPolicy.model_timestep` and converts its output.
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from gyremedia.backbones.denoising import DenoisingPolicy
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy, cast_weights
from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option, pretrained_source
from gyremedia.rollout import Media
from gyremedia.runtime.threads import in_own_thread

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unit_range(decoded: torch.Tensor) -> torch.Tensor:
    """A VAE's output in [-1, 1] as float32 in [0, 1], computed in place (the same bits as ``(x / 2 + 0.5).clamp``):
    out of place it held three copies of the batch at once, 2.3 GB for two 81-frame 480p clips."""
    return decoded.float().div_(2).add_(0.5).clamp_(0, 1)


@dataclass
class PipelineOptions:
    """Options every diffusers flow-matching backbone has; a backbone's options add its ``tiny`` sizes."""

    pretrained: str | None = option(None, check=pretrained_source, help="pipeline folder or hub id; None builds `tiny`")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "float32", help="weights of the frozen parts and the transformer"
    )
    max_sequence_length: int = option(256, ge=1, help="text tokens per prompt (the pipeline's max_sequence_length)")
    negative_prompt: str = option("", help="the unconditional prompt of classifier-free guidance")
    lora: LoraOptions = field(default_factory=LoraOptions)
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")
    # memory: the frozen parts need not sit on the training device
    text_encoders_on_cpu: bool = option(
        False,
        help="keep the text encoders in CPU memory: each prompt is encoded "
        "there once (cached) and its embedding moved to the device",
    )
    vae_slicing: bool = option(False, help="decode one sample at a time (less peak memory)")
    vae_tiling: bool = option(False, help="decode in overlapping tiles (large images and videos)")
    attention: Literal["sdpa", "xformers"] = option(
        "sdpa",
        help="the transformer's attention kernels: torch's scaled_dot_product_attention, or xformers (gpu extra)",
    )

    def validate(self) -> None:
        import importlib.util

        if self.attention == "xformers" and importlib.util.find_spec("xformers") is None:
            raise OptionError("attention", "xformers is not installed: pip install 'gyremedia[gpu]', or use sdpa")


def image_size(
    pipeline, height: int | None, width: int | None, multiple: int, default: int | None = None
) -> tuple[int, int]:
    """The image size in pixels: the given one, else ``default``, else the VAE's ``sample_size`` (stored in every
    pipeline folder); refused unless both are multiples of ``multiple``, which the pipelines would silently round
    down."""
    size = default or pipeline.vae.config.sample_size
    default_height, default_width = size if isinstance(size, (list, tuple)) else (size, size)
    height, width = height or default_height, width or default_width
    for name, pixels in (("height", height), ("width", width)):
        if pixels % multiple:
            raise OptionError(name, f"must be a multiple of {multiple} (the VAE factor times the 2x2 patches)")
    return height, width


class DiffusersFlowPolicy(TransformerPolicy, DenoisingPolicy):
    """A diffusers flow-matching pipeline seen as a policy over denoising transitions of its latent."""

    prediction = "velocity"
    prefetches = True  # prefetch(): encodes the next step's prompts in a thread while this step trains
    pipeline_class: ClassVar[str]  # the diffusers pipeline class a folder loads and an export is
    # what the transformer's ``timestep`` input is per unit of sigma (SD3 and Wan: 1000; FLUX, Qwen-Image: 1)
    timestep_scale: ClassVar[float] = 1000.0
    # the pipeline component that is the trained network (held as ``self.transformer``)
    denoiser_component: ClassVar[str] = "transformer"

    def __init__(self, options: PipelineOptions, context: BuildContext) -> None:
        self.options = options
        self.device = context.device
        dtype = DTYPES[options.dtype]
        pipeline_class = self.stock_pipeline_class()
        if options.pretrained:
            # a component saved as null (e.g. SD3 without T5) loads only when named as None
            index = pipeline_class.load_config(options.pretrained)
            absent = {
                name: None
                for name, entry in index.items()
                if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0] is None
            }
            self.pipeline = pipeline_class.from_pretrained(options.pretrained, dtype=dtype, **absent)
        else:
            self.pipeline = self.build_tiny(options)
            if dtype != torch.float32:
                for part in self.pipeline.components.values():
                    if isinstance(part, torch.nn.Module):
                        cast_weights(part, dtype)
        self.pipeline.set_progress_bar_config(disable=True)
        warn_once_per_kind(logging.getLogger(type(self.pipeline).__module__))
        self.pipeline.to(self.device)
        self.encoder_device = torch.device("cpu") if options.text_encoders_on_cpu else self.device
        for name, part in self.pipeline.components.items():
            if isinstance(part, torch.nn.Module) and name != self.denoiser_component:
                part.requires_grad_(False).eval()
                if name.startswith("text_encoder"):
                    part.to(self.encoder_device)
        for enabled, method in ((options.vae_slicing, "enable_slicing"), (options.vae_tiling, "enable_tiling")):
            if enabled:
                if not hasattr(self.pipeline.vae, method):
                    raise ValueError(f"{type(self.pipeline.vae).__name__} has no {method}(): turn it off")
                getattr(self.pipeline.vae, method)()
        self.transformer = getattr(self.pipeline, self.denoiser_component)
        if options.attention == "xformers":
            self.transformer.enable_xformers_memory_efficient_attention()
        self.scheduler = self.pipeline.scheduler
        self._prepare_training(options.lora, options.gradient_checkpointing, context.mixed_precision)
        self._prompt_cache: dict[str, dict[str, torch.Tensor]] = {}
        self._encode_lock = threading.Lock()  # `prefetch` fills the cache from another thread

    def stock_pipeline_class(self) -> type:
        """The diffusers class of ``self.pipeline_class`` (a subclass may set it per instance before loading)."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def build_tiny(self, options: PipelineOptions):
        """A tiny random-weight pipeline of this architecture from ``options.tiny`` (offline)."""
        raise NotImplementedError

    def _transformer_replaced(self) -> None:
        setattr(self.pipeline, self.denoiser_component, self.transformer)

    # ------------------------------------------------------------------ architecture hooks

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        """The conditions of one prompt, without a batch dimension (fixed shapes: they stack)."""
        raise NotImplementedError

    def state_shape(self) -> tuple[int, ...]:
        """The shape of one sample's state (the latent the sampler steps), without the batch dimension."""
        raise NotImplementedError

    def transformer_inputs(
        self, x: torch.Tensor, timestep: torch.Tensor, conditions: dict[str, torch.Tensor], guidance_scale: float
    ) -> dict[str, Any]:
        """The keyword arguments of the transformer for states ``x`` at ``timestep [B]``."""
        raise NotImplementedError

    def model_timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The network's ``timestep`` input at noise level ``sigma`` (fp32): ``timestep_scale * sigma``."""
        return sigma * self.timestep_scale

    def velocity(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The transformer's output as a velocity in the state's layout (e.g. unpacked)."""
        return output

    def negative_conditions(self, batch: int) -> dict[str, torch.Tensor]:
        """The unconditional branch of classifier-free guidance: ``batch`` rows of the negative prompt's conditions."""
        return self.encode([self.options.negative_prompt] * batch)

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether ``guidance_scale`` means classifier-free guidance (two predictions) for this model."""
        return guidance_scale > 1.0

    def guided(self, unconditional: torch.Tensor, conditional: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """Classifier-free guidance: ``v_u + s (v_c - v_u)``."""
        return unconditional + guidance_scale * (conditional - unconditional)

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        """Images in [0, 1] from the latents of an ``AutoencoderKL`` (``latent / scaling + shift``: SD3, FLUX.1)."""
        vae = self.pipeline.vae
        latents = final.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return Media("image", unit_range(vae.decode(latents, return_dict=False)[0]))

    def timesteps_arguments(self, num_steps: int) -> dict[str, Any]:
        """Extra ``scheduler.set_timesteps`` arguments the stock pipeline passes (e.g. sigmas and a shift ``mu``)."""
        return {}

    def resolution_shifted(self, num_steps: int, image_tokens: int) -> dict[str, Any]:
        """The ``set_timesteps`` arguments of FLUX's and Qwen-Image's pipelines: sigmas ``linspace(1, 1/N, N)``
        (not the scheduler's own grid), shifted by ``mu``, which grows linearly with the image's token count
        (diffusers' ``calculate_shift`` on the scheduler's config); ``mu`` acts only on a dynamically shifting
        scheduler."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        mu = calculate_shift(
            image_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    def generation_arguments(self) -> dict[str, Any]:
        """The stock pipeline's call arguments that reproduce how this model was trained (sizes, text length)."""
        return {"max_sequence_length": self.options.max_sequence_length}

    # ------------------------------------------------------------------ policy

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The noise levels the stock pipeline uses for ``num_steps`` steps, from 1 down to 0."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps, device=self.device, **self.timesteps_arguments(num_steps))
        return scheduler.sigmas.float()

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Conditions from the pipeline's own encoders, computed once per distinct prompt.

        Each prompt is encoded alone: a batched encoder's output can differ in its last bits with the
        batch it was computed in, and a resumed run (whose cache starts empty) must see the same numbers.
        """
        with self._encode_lock:
            for prompt in dict.fromkeys(prompts):
                if prompt not in self._prompt_cache:
                    with torch.no_grad():
                        encoded = self.encode_prompt(prompt)
                    self._prompt_cache[prompt] = {k: v.to(self.device) for k, v in encoded.items()}
            cache = self._prompt_cache
            return {key: torch.stack([cache[p][key] for p in prompts]) for key in cache[prompts[0]]}

    def prefetch(self, prompts: list[str]) -> None:
        """Encode the prompts of a later step in a background thread, while this one trains (the frozen
        encoders then run beside the denoiser instead of before it). The same per-prompt ``encode`` fills
        the cache, so the conditions are the same numbers as without it; a failure there resurfaces when
        the step itself encodes them. Prompts already cached start no thread; the thread ends with its encode
        (a lasting one would keep an OpenMP team that slows the trainer: :func:`gyremedia.runtime.threads.in_own_thread`)."""
        missing = [prompt for prompt in dict.fromkeys(prompts) if prompt not in self._prompt_cache]
        if missing:
            in_own_thread(self.encode, missing, name="gyremedia-prefetch")

    def sample_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        noise = torch.stack([torch.randn(self.state_shape(), generator=g) for g in generators])
        return noise.to(self.device, self.state_dtype)

    def predict(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The velocity at states ``x`` and noise level ``sigma`` (one for the batch, or one per sample)."""
        conditions = {k: v for k, v in conditions.items() if k != "preference"} | self.extra_conditions(
            conditions, reference
        )
        # in fp32 as the stock pipelines pass it (in bf16, 1000 sigma would round: 857.7 -> 856)
        timestep = self.model_timestep(sigma.float()).reshape(-1).expand(x.shape[0])
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            negative = self.negative_conditions(x.shape[0])
            conditions = {k: torch.cat([negative[k], v]) for k, v in conditions.items()}
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        output = self._forward(reference, **self.transformer_inputs(x, timestep, conditions, guidance_scale))
        output = self.velocity(output, x)
        if cfg:
            return self.guided(*output.chunk(2), guidance_scale)
        return output

    def extra_conditions(self, conditions: dict[str, torch.Tensor], reference: bool) -> dict[str, torch.Tensor]:
        """Conditions derived from others before the forward (SD3: the preference input); none by default."""
        if "preference" in conditions and not reference:
            raise ValueError(f"backbone {self.pipeline_class} takes no reward-preference input (ParetoSlider)")
        return {}

    # ------------------------------------------------------------------ export

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """Write a stock pipeline folder that diffusers loads without gyremedia.

        Under LoRA, ``merge_lora`` folds the adapters into a copy of the weights; otherwise only the
        adapters are written, in the format ``pipe.load_lora_weights(out_dir)`` reads.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        adapters_only = self.lora_enabled and not merge_lora
        (out_dir / "README.md").write_text(self.usage(out_dir, adapters_only))
        pipeline_class = self.stock_pipeline_class()
        if adapters_only:
            from peft import get_peft_model_state_dict

            component = self.denoiser_component  # e.g. transformer_lora_layers, unet_lora_layers
            pipeline_class.save_lora_weights(
                out_dir,
                **{
                    f"{component}_lora_layers": get_peft_model_state_dict(self.transformer),
                    f"{component}_lora_adapter_metadata": self.transformer.peft_config["default"].to_dict(),
                },
            )
            return
        # the pipeline's own settings beside its components (e.g. FLUX.2 klein's is_distilled)
        settings = {
            k: v
            for k, v in self.pipeline.config.items()
            if k in inspect.signature(pipeline_class.__init__).parameters and k not in self.pipeline.components
        }
        parts = {**self.pipeline.components, **settings, self.denoiser_component: self.export_transformer()}
        pipeline_class(**parts).save_pretrained(out_dir)

    def export_transformer(self) -> torch.nn.Module:
        """The transformer an export writes: LoRA merged, extra modules of our own removed."""
        return self._merged_transformer()

    def usage(self, out_dir: Path, adapters_only: bool) -> str:
        """How to load and call what :meth:`save_pretrained` wrote, with plain diffusers."""
        name = self.pipeline_class
        base = self.options.pretrained or "BASE_PIPELINE_FOLDER"
        arguments = "".join(f", {k}={v!r}" for k, v in self.generation_arguments().items())
        # components this pipeline lacks (e.g. SD3 without T5) load only when named as None
        optional = set(getattr(self.stock_pipeline_class(), "_optional_components", ()))
        absent = "".join(f", {n}=None" for n, c in self.pipeline.components.items() if c is None and n not in optional)
        lines = [
            "# Trained with gyremedia",
            "",
            "```python",
            f"from diffusers import {name}",
            "",
            f'pipe = {name}.from_pretrained("{base if adapters_only else out_dir}"{absent})',
        ]
        if adapters_only:
            lines.append(f'pipe.load_lora_weights("{out_dir}")')
        lines += [
            f'output = pipe(prompt="a prompt"{arguments})',
            "```",
            "",
            "The arguments after the prompt are the ones it was trained with (sizes, text tokens): "
            "other values work, but move away from what training saw. Pass the guidance it was trained "
            "with too: the run's `rollout.guidance_scale` (its config.yaml).",
            "",
        ]
        return "\n".join(lines)


class FirstOfEachWarning(logging.Filter):
    """Lets each kind of warning (its first 48 characters) through once: a pipeline's ``encode_prompt``
    warns about truncation for every prompt it encodes, which would flood a run's log (and cost time)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.getMessage()[:48]
        if kind in self.seen:
            return False
        self.seen.add(kind)
        return True


def warn_once_per_kind(logger: logging.Logger) -> None:
    """Install :class:`FirstOfEachWarning` on ``logger`` (once)."""
    if not any(isinstance(f, FirstOfEachWarning) for f in logger.filters):
        logger.addFilter(FirstOfEachWarning())
