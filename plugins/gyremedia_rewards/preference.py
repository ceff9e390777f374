"""Human-preference rewards on CLIP, loaded with transformers' stock classes from a local folder or hub id.

- ``pickscore`` (Kirstain et al. 2023, ``yuvalkirstain/PickScore_v1`` with the processor of
  ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``): ``logit_scale.exp() * cos(image, prompt)``, as the PickScore
  README's inference example computes it, divided by ``scale``: Flow-GRPO's ``pickscore_scorer.py`` divides by 26
  to bring it near [0, 1] (its published curves are in those units); ``scale: 1`` keeps PickScore's own.
- ``hpsv2`` (Wu et al. 2023, Human Preference Score v2 / v2.1): open_clip's ViT-H-14 with the HPS checkpoint;
  the score is the cosine of image and prompt, the diagonal of ``image_features @ text_features.T`` as HPSv2's
  ``img_score.py`` computes it, the image through open_clip's own validation transform (``preprocess_val``).
- ``aesthetic`` (the LAION aesthetic predictor v2, ``sac+logos+ava1-l14-linearMSE.pth``): a linear MLP
  (768 -> 1024 -> 128 -> 64 -> 16 -> 1, dropout between, no activations) on the unit CLIP ViT-L/14 image
  embedding, as LAION's ``simple_inference.py`` and Flow-GRPO's ``aesthetic_scorer.py`` compute it; about 1 to 10.

Both preprocess as their references do: the model's ``CLIPProcessor`` on 8-bit RGB images (the shortest side
resized bicubically, a centre crop, rescaling and CLIP's normalisation), prompts padded and truncated to 77 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gyremedia.interfaces import BuildContext
from gyremedia.media_io import eight_bit
from gyremedia.options import OptionError, option, pretrained_source
from gyremedia.rollout import Media

AESTHETIC_LAYERS = (1024, 128, 64, 16, 1)  # the LAION predictor's linear widths after the embedding


def predictor_file(value: str) -> str | None:
    """An existing weights file of the predictor."""
    if not value.endswith((".pth", ".pt", ".safetensors")):
        return "give the predictor's weights file (.pth, .pt or .safetensors)"
    return None if Path(value).expanduser().is_file() else "no such file"


@dataclass
class PickScoreOptions:
    model: str = option("yuvalkirstain/PickScore_v1", check=pretrained_source, help="a CLIPModel folder or hub id")
    processor: str = option(
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        check=pretrained_source,
        help="the CLIPProcessor folder or hub id PickScore was trained with",
    )
    scale: float = option(
        26.0, gt=0, help="the score is logit_scale x cosine / scale (Flow-GRPO: 26; 1: PickScore's own units)"
    )
    batch_size: int = option(32, ge=1, help="images per forward pass")


@dataclass
class AestheticOptions:
    predictor: str | None = option(
        None,
        check=predictor_file,
        help="the LAION aesthetic predictor's state dict (sac+logos+ava1-l14-linearMSE.pth, or .safetensors)",
    )
    model: str = option(
        "openai/clip-vit-large-patch14",
        check=pretrained_source,
        help="the CLIPModel (and its processor) the predictor reads: ViT-L/14",
    )
    batch_size: int = option(32, ge=1, help="images per forward pass")

    def validate(self) -> None:
        if self.predictor is None:
            raise OptionError(
                "predictor",
                "give the LAION predictor's weights file, e.g. sac+logos+ava1-l14-linearMSE.pth from its repository",
            )


@dataclass
class HPSv2Options:
    checkpoint: str | None = option(
        None,
        check=lambda v: None if Path(v).expanduser().is_file() else "no such file",
        help="the HPS checkpoint (HPS_v2.1_compressed.pt, or HPS_v2_compressed.pt)",
    )
    model: str = option(
        "ViT-H-14",
        help="the open_clip architecture it fine-tunes (HPSv2: ViT-H-14), or the path of a model-config json",
    )
    batch_size: int = option(32, ge=1, help="images per forward pass")

    def validate(self) -> None:
        if self.checkpoint is None:
            raise OptionError(
                "checkpoint", "give the HPS checkpoint file, e.g. HPS_v2.1_compressed.pt from xswu/HPSv2 on the hub"
            )


def _pil(images: torch.Tensor) -> list:
    """``[B, 3, H, W]`` images in [0, 1] as 8-bit RGB PIL images (what the references feed their processors)."""
    from PIL import Image

    pixels = eight_bit(images).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(p) for p in pixels]


def projected(features) -> torch.Tensor:
    """The projected embeddings ``get_image_features`` / ``get_text_features`` return: a tensor before transformers
    5, the output's ``pooler_output`` since."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


class _Clip:
    """A frozen transformers ``CLIPModel`` and its processor, on one device."""

    def __init__(self, model: str, processor: str, device: torch.device) -> None:
        from transformers import CLIPModel, CLIPProcessor

        self.model = CLIPModel.from_pretrained(model).to(device).eval().requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(processor)
        self.device = device

    @torch.no_grad()
    def images(self, images: torch.Tensor) -> torch.Tensor:
        inputs = self.processor(images=_pil(images), return_tensors="pt").to(self.device)
        return torch.nn.functional.normalize(projected(self.model.get_image_features(**inputs)), dim=-1)

    @torch.no_grad()
    def texts(self, texts: list[str]) -> torch.Tensor:
        inputs = self.processor(
            text=[str(t) for t in texts], padding=True, truncation=True, max_length=77, return_tensors="pt"
        ).to(self.device)
        return torch.nn.functional.normalize(projected(self.model.get_text_features(**inputs)), dim=-1)


def reward_device(context: BuildContext | None, chosen: str | None = None) -> torch.device:
    """Where a reward's model runs: ``chosen`` when its options name a device, else the run's (CPU outside one)."""
    if chosen:
        return torch.device(chosen)
    return context.device if context is not None else torch.device("cpu")


class PickScore:
    """``score``: PickScore / ``scale``; ``pickscore``: in PickScore's own units."""

    kinds = {"image"}

    def __init__(self, options: PickScoreOptions, context: BuildContext | None = None) -> None:
        self.clip = _Clip(options.model, options.processor, reward_device(context))
        self.scale, self.batch_size = options.scale, options.batch_size

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        cosine = (self.clip.images(media.data) * self.clip.texts(prompts)).sum(-1)
        pickscore = (self.clip.model.logit_scale.exp() * cosine).float().cpu()
        return {"score": pickscore / self.scale, "pickscore": pickscore}


def aesthetic_head(width: int) -> torch.nn.Sequential:
    """The LAION aesthetic predictor's MLP: linear layers with dropout between the first four, no activations."""
    layers, dropouts = [], (0.2, 0.2, 0.1)
    for i, out in enumerate(AESTHETIC_LAYERS):
        layers.append(torch.nn.Linear(width, out))
        if i < len(dropouts):
            layers.append(torch.nn.Dropout(dropouts[i]))
        width = out
    return torch.nn.Sequential(*layers)


class AestheticScore:
    """The LAION aesthetic predictor's rating of each image (about 1 to 10)."""

    kinds = {"image"}

    def __init__(self, options: AestheticOptions, context: BuildContext | None = None) -> None:
        self.clip = _Clip(options.model, options.model, reward_device(context))
        self.head = aesthetic_head(self.clip.model.config.projection_dim)
        if options.predictor.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(Path(options.predictor).expanduser())
        else:
            state = torch.load(Path(options.predictor).expanduser(), map_location="cpu", weights_only=True)
        self.head.load_state_dict({key.removeprefix("layers."): value for key, value in state.items()})
        self.head.to(self.clip.device).eval().requires_grad_(False)
        self.batch_size = options.batch_size

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        return {"score": self.head(self.clip.images(media.data))[:, 0].float().cpu()}


class HPSv2:
    """Human Preference Score v2(.1): ``cos(image, prompt)`` under the HPS-tuned open_clip ViT-H-14."""

    kinds = {"image"}

    def __init__(self, options: HPSv2Options, context: BuildContext | None = None) -> None:
        import open_clip

        name = options.model
        if name.endswith(".json"):
            open_clip.add_model_config(Path(name))
            name = Path(name).stem
        device = reward_device(context)
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(name, pretrained=None, device=device)
        state = torch.load(Path(options.checkpoint).expanduser(), map_location=device, weights_only=True)
        self.model.load_state_dict(state.get("state_dict", state))
        self.model.eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(name)
        self.device, self.batch_size = device, options.batch_size

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        images = torch.stack([self.preprocess(picture) for picture in _pil(media.data)]).to(self.device)
        out = self.model(images, self.tokenizer([str(p) for p in prompts]).to(self.device))
        image_features, text_features = (
            (out["image_features"], out["text_features"]) if isinstance(out, dict) else out[:2]
        )
        return {"score": (image_features * text_features).sum(-1).float().cpu()}
