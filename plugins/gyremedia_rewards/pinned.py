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

So each is served from an environment of its own with ``gyremedia serve-reward`` and trained on through the
``remote`` reward (README, "Rewards the field uses"). Both take 8-bit RGB PIL images, as their packages expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gyremedia.interfaces import BuildContext
from gyremedia.options import option
from gyremedia.rollout import Media
from gyremedia_rewards.preference import _pil, reward_device


def _reference(module: str, package: str):
    """The reference package, or an error that says where it runs."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"needs the {package} package, which pins versions that cannot install beside the trainer's "
                          f"({exc}): serve this reward from an environment of its own (`pip install {package}`, then "
                          f"`gyremedia serve-reward ...`) and train with the remote reward") from exc


def _file_or_none(value: str) -> str | None:
    return None if Path(value).expanduser().is_file() else "no such file"


@dataclass
class ImageRewardOptions:
    model: str = option("ImageReward-v1.0", help="ImageReward-v1.0 (the package downloads it to ~/.cache/ImageReward) "
                                                 "or the path of its ImageReward.pt",
                        check=lambda v: None if v == "ImageReward-v1.0" or Path(v).expanduser().is_file()
                        else "no such file: give ImageReward-v1.0 or the path of ImageReward.pt")
    med_config: str | None = option(None, check=_file_or_none, help="its BLIP text encoder's med_config.json (default: "
                                                                    "the package fetches it)")


class ImageReward:
    """ImageReward's standardised score of each image for its prompt."""

    kinds = {"image"}

    def __init__(self, options: ImageRewardOptions, context: BuildContext | None = None) -> None:
        package = _reference("ImageReward", "image-reward")
        self.model = package.load(options.model, device=str(reward_device(context)), med_config=options.med_config)

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        return {"score": torch.tensor([float(self.model.score(str(prompt), image))
                                       for prompt, image in zip(prompts, _pil(media.data))])}


@dataclass
class HPSv3Options:
    checkpoint: str | None = option(None, check=_file_or_none, help="HPSv3.safetensors (default: the package fetches "
                                                                    "MizzenAI/HPSv3 from the hub)")
    config: str | None = option(None, check=_file_or_none, help="the inference yaml (default: the package's HPSv3_7B)")
    batch_size: int = option(8, ge=1, help="images per forward pass")


class HPSv3:
    """HPSv3's predicted mean preference of each image for its prompt (``score``) and its spread (``sigma``)."""

    kinds = {"image"}

    def __init__(self, options: HPSv3Options, context: BuildContext | None = None) -> None:
        package = _reference("hpsv3", "hpsv3")
        self.inferencer = package.HPSv3RewardInferencer(config_path=options.config, checkpoint_path=options.checkpoint,
                                                        device=str(reward_device(context)))
        self.batch_size = options.batch_size

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        rewards = torch.as_tensor(self.inferencer.reward(_pil(media.data), [str(p) for p in prompts])).float().cpu()
        return {"score": rewards[:, 0], "sigma": rewards[:, 1]}
