"""Rewards that run their reference package's own scoring code, in that package's own environment.

Their packages pin stacks that cannot install beside the trainer's (checked on this project's pins):

- ``image_reward`` (Xu et al. 2023, the ``image-reward`` package, ``ImageReward.load`` then ``model.score(prompt,
  image)`` per sample, as its README and Flow-GRPO's ``imagereward_scorer.py`` call it; the score is standardised
  by the package's own mean and std). Its BLIP text encoder imports ``apply_chunking_to_forward`` from
  ``transformers.modeling_utils``, gone in transformers 5; it also pins ``timm==0.6.13`` and ``fairscale`` and
  needs OpenAI's ``clip`` (which needs ``pkg_resources``).
- ``hpsv3`` (Ma et al. 2025, the ``hpsv3`` package, ``HPSv3RewardInferencer(...).reward(images, prompts)``; the
  model predicts a mean and a spread per image, and the mean is the score, as its README's example takes
  ``rewards[i][0]``; ``sigma`` is logged beside it). It pins ``transformers==4.45.2``.

- ``videoalign`` (VideoReward, Liu et al. 2025, the KwaiVGI/VideoAlign repository's ``inference.py``,
  ``VideoVLMRewardInference(checkpoint, device=, dtype=).reward(video_paths, prompts, use_norm=True)``): visual
  quality ``VQ``, motion quality ``MQ`` and text alignment ``TA``, rescaled by the checkpoint's own means and
  stds; ``score`` is their sum ``Overall``, as the repository computes it. It is a repository, not a package
  (its ``environment.yaml`` pins ``torch==2.3.1`` and ``transformers==4.45.2``) and reads videos from files, so
  each clip is written to a temporary MP4 at the media's fps (``imageio`` with ``imageio-ffmpeg`` in that
  environment) as its own examples do.

So each is served from an environment of its own with ``gyremedia serve-reward`` and trained on through the
``remote`` reward (README, "Rewards the field uses"). Both take 8-bit RGB PIL images, as their packages expect.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from gyremedia.interfaces import BuildContext
from gyremedia.media_io import eight_bit
from gyremedia.options import OptionError, option
from gyremedia.rollout import Media
from gyremedia_rewards.preference import _pil, reward_device


def _reference(module: str, what: str, install: str):
    """The reference code's module, or an error that says where it runs (``install``: how its environment gets it)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"needs {what} ({exc}), whose pins cannot install beside the trainer's: serve this reward "
            f"from an environment of its own ({install}, then `gyremedia serve-reward ...`) and train "
            "with the remote reward"
        ) from exc


def _file_or_none(value: str) -> str | None:
    return None if Path(value).expanduser().is_file() else "no such file"


@dataclass
class ImageRewardOptions:
    model: str = option(
        "ImageReward-v1.0",
        help="ImageReward-v1.0 (the package downloads it to ~/.cache/ImageReward) or the path of its ImageReward.pt",
        check=lambda v: (
            None
            if v == "ImageReward-v1.0" or Path(v).expanduser().is_file()
            else "no such file: give ImageReward-v1.0 or the path of ImageReward.pt"
        ),
    )
    med_config: str | None = option(
        None, check=_file_or_none, help="its BLIP text encoder's med_config.json (default: the package fetches it)"
    )


class ImageReward:
    """ImageReward's standardised score of each image for its prompt."""

    kinds = {"image"}

    def __init__(self, options: ImageRewardOptions, context: BuildContext | None = None) -> None:
        package = _reference("ImageReward", "the image-reward package", "pip install image-reward")
        self.model = package.load(options.model, device=str(reward_device(context)), med_config=options.med_config)

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        return {
            "score": torch.tensor(
                [float(self.model.score(str(prompt), image)) for prompt, image in zip(prompts, _pil(media.data))]
            )
        }


@dataclass
class HPSv3Options:
    checkpoint: str | None = option(
        None, check=_file_or_none, help="HPSv3.safetensors (default: the package fetches MizzenAI/HPSv3 from the hub)"
    )
    config: str | None = option(None, check=_file_or_none, help="the inference yaml (default: the package's HPSv3_7B)")
    batch_size: int = option(8, ge=1, help="images per forward pass")


class HPSv3:
    """HPSv3's predicted mean preference of each image for its prompt (``score``) and its spread (``sigma``)."""

    kinds = {"image"}

    def __init__(self, options: HPSv3Options, context: BuildContext | None = None) -> None:
        package = _reference("hpsv3", "the hpsv3 package", "pip install hpsv3")
        self.inferencer = package.HPSv3RewardInferencer(
            config_path=options.config, checkpoint_path=options.checkpoint, device=str(reward_device(context))
        )
        self.batch_size = options.batch_size

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        rewards = torch.as_tensor(self.inferencer.reward(_pil(media.data), [str(p) for p in prompts])).float().cpu()
        return {"score": rewards[:, 0], "sigma": rewards[:, 1]}


@dataclass
class VideoAlignOptions:
    repository: str | None = option(
        None,
        check=lambda v: None if (Path(v).expanduser() / "inference.py").is_file() else "no inference.py there",
        help="a checkout of KwaiVGI/VideoAlign",
    )
    checkpoint: str | None = option(
        None,
        check=lambda v: None if Path(v).expanduser().is_dir() else "no such folder",
        help="the VideoReward checkpoint folder (KwaiVGI/VideoReward from the hub)",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = option("bfloat16", help="the reward model's weights")
    use_norm: bool = option(True, help="rescale by the checkpoint's means and stds, as the repository's example")
    batch_size: int = option(4, ge=1, help="clips per forward pass")

    def validate(self) -> None:
        for key in ("repository", "checkpoint"):
            if getattr(self, key) is None:
                raise OptionError(key, "give the VideoAlign checkout and the VideoReward checkpoint folder")


class VideoAlign:
    """VideoReward's ``Overall`` (``score``) and its ``VQ``, ``MQ`` and ``TA`` of each clip for its prompt."""

    kinds = {"video"}

    def __init__(self, options: VideoAlignOptions, context: BuildContext | None = None) -> None:
        repository = str(Path(options.repository).expanduser())
        if repository not in sys.path:
            sys.path.insert(0, repository)
        inference = _reference(
            "inference",
            "the VideoAlign repository's inference.py",
            "conda env create -f environment.yaml in the checkout",
        )
        self.imageio = _reference("imageio", "imageio", "pip install imageio imageio-ffmpeg")
        self.inferencer = inference.VideoVLMRewardInference(
            str(Path(options.checkpoint).expanduser()),
            device=str(reward_device(context)),
            dtype=getattr(torch, options.dtype),
        )
        self.use_norm, self.batch_size = options.use_norm, options.batch_size

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        frames = eight_bit(media.data)  # [B, T, 3, H, W]
        with tempfile.TemporaryDirectory() as folder:
            paths = []
            for i, clip in enumerate(frames):
                paths.append(str(Path(folder) / f"{i}.mp4"))
                self.imageio.mimwrite(paths[-1], list(clip.permute(0, 2, 3, 1).numpy()), fps=media.meta.get("fps", 16))
            rewards = self.inferencer.reward(paths, [str(p) for p in prompts], use_norm=self.use_norm)
        out = {key: torch.tensor([float(r[key]) for r in rewards]) for key in ("VQ", "MQ", "TA")}
        return {"score": torch.tensor([float(r["Overall"]) for r in rewards]), **out}
