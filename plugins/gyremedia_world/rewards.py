"""Verifiable rewards for generated GridWalk clips, computed from the media and the prompt alone.

``inverse_dynamics`` (RLIR): an inverse dynamics model reads back the action between consecutive
frames (the context frame, then each generated one) and is scored against the commanded actions.
``world_fidelity`` (RLVR-World): PSNR and SSIM of each generated frame against the environment's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from gyremedia.config import asset_path
from gyremedia.options import existing_folder, option
from gyremedia.rollout import Media
from gyremedia_world.env import Episode, parse_prompt
from gyremedia_world.inverse_dynamics import InverseDynamicsModel


def _episodes(media: Media, prompts: list[str]) -> list[Episode]:
    """The prompts' episodes, checked against the clip length of the media."""
    episodes = [parse_prompt(p) for p in prompts]
    frames = media.data.shape[1]
    for prompt, episode in zip(prompts, episodes):
        if len(episode.actions) != frames:
            raise ValueError(f"prompt {prompt!r} commands {len(episode.actions)} actions for a clip of {frames} frames")
    return episodes


@dataclass
class InverseDynamicsOptions:
    model: str | None = option(
        None,
        check=existing_folder("a folder written by `python -m gyremedia_world.pretrain`"),
        help="folder of an inverse dynamics model; None = the shipped assets/world16 one",
    )
    score: Literal["accuracy", "log_likelihood"] = option(
        "accuracy", help="share of actions recovered, or mean log p(action)"
    )


class InverseDynamicsReward:
    """``score`` plus ``accuracy`` and ``log_likelihood`` of the commanded actions under the model."""

    kinds = {"video"}
    batch_size = 256

    def __init__(self, options: InverseDynamicsOptions, context=None) -> None:
        self.score = options.score
        self.model = InverseDynamicsModel.load(options.model or asset_path("world16/inverse_dynamics"))

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        episodes = _episodes(media, prompts)
        video = media.data.detach().float().cpu()  # [B, T, 3, H, W]
        context = torch.stack([torch.from_numpy(e.context()) for e in episodes])
        frames = torch.cat([context[:, None], video], dim=1)
        batch, steps = video.shape[:2]
        logits = self.model(frames[:, :-1].flatten(0, 1), frames[:, 1:].flatten(0, 1)).view(batch, steps, -1)
        actions = torch.tensor([e.actions for e in episodes])
        accuracy = (logits.argmax(-1) == actions).float().mean(1)
        log_likelihood = logits.log_softmax(-1).gather(-1, actions[..., None])[..., 0].mean(1)
        return {
            "score": accuracy if self.score == "accuracy" else log_likelihood,
            "accuracy": accuracy,
            "log_likelihood": log_likelihood,
        }


@dataclass
class FidelityOptions:
    # psnr (dB, capped at 50) | ssim (in [-1, 1], 1 = identical). PSNR by default: on these mostly flat
    # frames SSIM's structure term punishes faint background noise more than a misplaced agent.
    score: Literal["psnr", "ssim"] = option("psnr", help="what the score is")


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per frame of ``[N, C, H, W]`` images in [0, 1], capped at 50."""
    mse = ((a - b) ** 2).flatten(1).mean(1)
    return (10 * torch.log10(1 / mse.clamp(min=1e-5))).clamp(max=50)


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 7, sigma: float = 1.5) -> torch.Tensor:
    """Structural similarity per frame of ``[N, C, H, W]`` images in [0, 1] (Gaussian window, Wang et al. 2004)."""
    coords = torch.arange(window, dtype=torch.float32) - window // 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    kernel = (g[:, None] * g[None, :] / g.sum() ** 2).expand(a.shape[1], 1, window, window)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, kernel, groups=a.shape[1])

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a**2, blur(b * b) - mu_b**2, blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    value = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return value.flatten(1).mean(1)


class FidelityReward:
    """``score`` plus ``psnr`` and ``ssim`` of the clip against the environment's true frames (frame mean)."""

    kinds = {"video"}

    def __init__(self, options: FidelityOptions, context=None) -> None:
        self.score = options.score

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        episodes = _episodes(media, prompts)
        video = media.data.detach().float().cpu()
        truth = torch.stack([torch.from_numpy(e.truth()) for e in episodes])
        batch = video.shape[0]
        values = {
            "psnr": psnr(video.flatten(0, 1), truth.flatten(0, 1)).view(batch, -1).mean(1),
            "ssim": ssim(video.flatten(0, 1), truth.flatten(0, 1)).view(batch, -1).mean(1),
        }
        return {"score": values[self.score], **values}
