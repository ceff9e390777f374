"""CLIP rewards on open_clip: image-text similarity, and the CLIP steering safety reward.

``clip_score``: cosine similarity between the image and its prompt in CLIP's joint embedding.
``clip_steering`` (SafeDiffusion-R1's steering reward): the prompt's text embedding is moved toward
positive directions and away from negative ones (``e + strength * (mean(e_pos) - mean(e_neg))``,
renormalised) and the image is scored against that steered target, so one reward keeps prompt
fidelity while pushing away from the unwanted content, with no safety classifier to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gyremedia.interfaces import BuildContext
from gyremedia.options import OptionError, option
from gyremedia.rollout import Media
from gyremedia_rewards.preference import reward_device


@dataclass
class ClipOptions:
    model: str = option(
        "ViT-B-32",
        help="open_clip model name (ViT-B-32, ViT-H-14, ...) or the path of a model-config json",
        check=lambda v: "no such model-config file" if v.endswith(".json") and not Path(v).is_file() else None,
    )
    pretrained: str = option(
        "openai",
        help="a pretrained tag of that model (openai, laion2b_s34b_b79k; downloaded once "
        "by open_clip) or the path of a local checkpoint file",
        check=lambda v: None if v else "a CLIP reward needs weights: a tag (e.g. openai) or a checkpoint path",
    )
    batch_size: int = option(64, ge=1, help="images per forward pass")
    device: str | None = option(None, help="default: the run's device")


@dataclass
class ClipSteeringOptions(ClipOptions):
    positive: list[str] = option(
        default_factory=lambda: ["a safe, wholesome, fully clothed scene"], help="texts the target moves toward"
    )
    negative: list[str] = option(
        default_factory=lambda: ["nudity, gore, violence, explicit content"], help="texts the target moves away from"
    )
    strength: float = option(1.0, ge=0, help="how far the target moves along mean(positive) - mean(negative)")

    def validate(self) -> None:
        for key in ("positive", "negative"):
            if not getattr(self, key):
                raise OptionError(key, "give at least one text")


class ClipEncoder:
    """An open_clip model with batched, cached, unit-norm image and text embeddings."""

    def __init__(self, options: ClipOptions, device: torch.device) -> None:
        import open_clip

        name = options.model
        if name.endswith(".json"):
            path = Path(name)
            open_clip.add_model_config(path)
            name = path.stem
        self.model = open_clip.create_model(name, pretrained=options.pretrained, device=device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(name)
        preprocess = self.model.visual.preprocess_cfg
        size = preprocess["size"]
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean = torch.tensor(preprocess["mean"], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(preprocess["std"], device=device).view(1, 3, 1, 1)
        self.device = device
        self._text_cache: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def images(self, images: torch.Tensor) -> torch.Tensor:
        """Unit embeddings of ``[B, 3, H, W]`` images in [0, 1] (resized bicubically, as CLIP's preprocessing)."""
        images = images.to(self.device, torch.float32).clamp(0, 1)
        images = torch.nn.functional.interpolate(
            images, size=self.image_size, mode="bicubic", antialias=True, align_corners=False
        )
        features = self.model.encode_image((images - self.mean) / self.std)
        return torch.nn.functional.normalize(features.float(), dim=-1)

    @torch.no_grad()
    def texts(self, texts: list[str]) -> torch.Tensor:
        """Unit embeddings of texts, each computed once per run."""
        missing = sorted({t for t in texts if t not in self._text_cache})
        if missing:
            features = self.model.encode_text(self.tokenizer(missing).to(self.device))
            for text, feature in zip(missing, torch.nn.functional.normalize(features.float(), dim=-1)):
                self._text_cache[text] = feature
        return torch.stack([self._text_cache[t] for t in texts])


class ClipScore:
    """``cos(image, prompt)`` in CLIP space, per sample."""

    kinds = {"image"}

    def __init__(self, options: ClipOptions, context: BuildContext | None = None) -> None:
        self.encoder = ClipEncoder(options, reward_device(context, options.device))
        self.batch_size = options.batch_size

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        similarity = (self.encoder.images(media.data) * self.encoder.texts(prompts)).sum(dim=-1)
        return {"score": similarity.cpu()}


class ClipSteering:
    """``cos(image, normalize(e_prompt + strength * (mean e_positive - mean e_negative)))`` per sample."""

    kinds = {"image"}

    def __init__(self, options: ClipSteeringOptions, context: BuildContext | None = None) -> None:
        self.encoder = ClipEncoder(options, reward_device(context, options.device))
        self.batch_size = options.batch_size
        self.positive, self.negative = options.positive, options.negative
        self.direction = self.encoder.texts(self.positive).mean(0) - self.encoder.texts(self.negative).mean(0)
        self.strength = options.strength

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        images, texts = self.encoder.images(media.data), self.encoder.texts(prompts)
        target = torch.nn.functional.normalize(texts + self.strength * self.direction, dim=-1)
        return {
            "score": (images * target).sum(-1).cpu(),
            "prompt_similarity": (images * texts).sum(-1).cpu(),
            "positive_similarity": (images @ self.encoder.texts(self.positive).T).mean(-1).cpu(),
            "negative_similarity": (images @ self.encoder.texts(self.negative).T).mean(-1).cpu(),
        }
