"""Verifiable rewards for generated GridWalk clips, computed from the media and the prompt alone.

``inverse_dynamics`` (RLIR): an inverse dynamics model reads back the action between consecutive
frames (the context frame, then each generated one) and is scored against the commanded actions.
``world_fidelity`` (RLVR-World): PSNR, SSIM and the agent's overlap of each generated frame against the
environment's own.

The clip scored is a prompt's last one (a prompt may command several clips: the clips before it are history).
Its context frame is the media's first frame when ``media.meta["context_frame"]`` says so (a training rollout
continuing from the model's own frames), else the environment's frame before the clip. Both rewards also
report each frame's score (``frames``, ``[B, T]``), for per-frame advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from gyremedia.config import asset_path
from gyremedia.options import existing_folder, option
from gyremedia.rollout import Media
from gyremedia_world.env import AGENT_COLOURS, Episode, parse_prompt, start_state
from gyremedia_world.inverse_dynamics import InverseDynamicsModel


def _clips(media: Media, prompts: list[str]) -> tuple[list[Episode], torch.Tensor, torch.Tensor]:
    """The prompts' episodes, the generated clips ``[B, T, 3, H, W]`` and the frames they continued from
    ``[B, 3, H, W]``, checked against the number of actions each prompt commands."""
    video = media.data.detach().float().cpu()
    starts_with_context = bool(media.meta.get("context_frame"))
    clips = video[:, 1:] if starts_with_context else video
    frames, episodes = clips.shape[1], [parse_prompt(p) for p in prompts]
    for prompt, episode in zip(prompts, episodes):
        if not episode.actions or len(episode.actions) % frames:
            raise ValueError(
                f"prompt {prompt!r} commands {len(episode.actions)} actions for clips of {frames} frames: "
                "a prompt commands whole clips, the last one generated"
            )
    if starts_with_context:
        return episodes, clips, video[:, 0]
    context = torch.stack([torch.from_numpy(e.context(len(e.actions) - frames)) for e in episodes])
    return episodes, clips, context


def _truth(episodes: list[Episode], frames: int) -> torch.Tensor:
    """The environment's own frames of each episode's last ``frames`` actions, ``[B, T, 3, H, W]``."""
    return torch.stack([torch.from_numpy(e.truth()[-frames:]) for e in episodes])


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
    frame_scores = True
    batch_size = 256

    def __init__(self, options: InverseDynamicsOptions, context=None) -> None:
        self.score = options.score
        self.model = InverseDynamicsModel.load(options.model or asset_path("world16/inverse_dynamics"))

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        episodes, video, context = _clips(media, prompts)
        frames = torch.cat([context[:, None], video], dim=1)
        batch, steps = video.shape[:2]
        logits = self.model(frames[:, :-1].flatten(0, 1), frames[:, 1:].flatten(0, 1)).view(batch, steps, -1)
        actions = torch.tensor([e.actions[-steps:] for e in episodes])
        right = (logits.argmax(-1) == actions).float()
        log_likelihood = logits.log_softmax(-1).gather(-1, actions[..., None])[..., 0]
        per_frame = right if self.score == "accuracy" else log_likelihood
        return {
            "score": per_frame.mean(1),
            "accuracy": right.mean(1),
            "log_likelihood": log_likelihood.mean(1),
            "frames": per_frame,
        }


@dataclass
class FidelityOptions:
    # psnr (dB, capped at 50) | ssim (in [-1, 1], 1 = identical) | agent (the agent's pixels, generated against
    # true: intersection over union). PSNR by default: on these mostly flat frames SSIM's structure term punishes
    # faint background noise more than a misplaced agent. An agent that breaks up or vanishes costs PSNR little
    # (it is 16 of 256 pixels); `agent` scores that object itself.
    score: Literal["psnr", "ssim", "agent"] = option("psnr", help="what the score is")


AGENT_TOLERANCE = 0.25  # a pixel within this of the agent's colour in every channel is the agent's


def agent_overlap(video: torch.Tensor, truth: torch.Tensor, colours: torch.Tensor) -> torch.Tensor:
    """Per frame of ``[N, 3, H, W]`` images in [0, 1]: the intersection over union of the pixels of the agent's
    colour (``colours [N, 3]``) in ``video`` and in ``truth``; 1 for identical frames, 0 for a vanished agent."""
    colour = colours[:, :, None, None]
    generated = ((video - colour).abs() < AGENT_TOLERANCE).all(dim=1).flatten(1)
    true = ((truth - colour).abs() < AGENT_TOLERANCE).all(dim=1).flatten(1)
    return (generated & true).sum(1) / (generated | true).sum(1).clamp(min=1)


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
    frame_scores = True

    def __init__(self, options: FidelityOptions, context=None) -> None:
        self.score = options.score

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        episodes, video, _ = _clips(media, prompts)
        truth = _truth(episodes, video.shape[1])
        batch = video.shape[0]
        colours = torch.tensor([AGENT_COLOURS[start_state(e.episode).colour] for e in episodes])
        colours = colours.repeat_interleave(video.shape[1], dim=0)
        values = {
            "psnr": psnr(video.flatten(0, 1), truth.flatten(0, 1)).view(batch, -1),
            "ssim": ssim(video.flatten(0, 1), truth.flatten(0, 1)).view(batch, -1),
            "agent": agent_overlap(video.flatten(0, 1), truth.flatten(0, 1), colours).view(batch, -1),
        }
        return {
            "score": values[self.score].mean(1),
            **{k: v.mean(1) for k, v in values.items()},
            "frames": values[self.score],
        }
