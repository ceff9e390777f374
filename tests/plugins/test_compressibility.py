"""DDPO's JPEG-size reward: a video scores the mean of its frames' scores as images."""

from __future__ import annotations

import torch

from gyremedia.rollout import Media
from gyremedia_rewards.compressibility import JpegCompressibility, JpegOptions


def test_a_video_scores_the_mean_of_its_frames():
    reward = JpegCompressibility(JpegOptions())
    video = torch.rand(2, 3, 3, 16, 24, generator=torch.Generator().manual_seed(0))  # [B, T, 3, H, W]
    video[1] = video[1] * 0.1  # a darker, flatter clip compresses better
    frames = reward(Media("image", video.reshape(-1, 3, 16, 24)), [""] * 6)["size_kb"].reshape(2, 3)
    scored = reward(Media("video", video), ["", ""])
    torch.testing.assert_close(scored["size_kb"], frames.mean(dim=1))
    assert scored["score"][1] > scored["score"][0]
