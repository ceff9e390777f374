"""DDPO's (in)compressibility reward: the size of an image's JPEG encoding.

Rewarding small files pushes a generator to flat, simple images; rewarding large ones (a negative
weight, or ``sign: 1``) to detailed, textured images. Deterministic and weight-free. A video scores the
mean size of its frames.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from gyremedia.options import option
from gyremedia.rollout import Media


@dataclass
class JpegOptions:
    quality: int = option(95, ge=1, le=100, help="JPEG quality used to measure the size (DDPO: 95)")
    sign: Literal[-1, 1] = option(-1, help="-1 rewards compressible images, +1 incompressible ones")


class JpegCompressibility:
    """``sign * size_kB(JPEG(image))`` per image (per video: averaged over its frames)."""

    kinds = {"image", "video"}

    def __init__(self, options: JpegOptions, context=None) -> None:
        self.quality = options.quality
        self.sign = options.sign

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        data = media.data.detach().cpu()
        frames = data.shape[1] if media.kind == "video" else 1  # video: [B, T, 3, H, W]
        sizes = []
        # one frame at a time, each a view: an 81-frame clip at 480p is 0.4 GB of floats, and converting the batch
        # at once made three more copies (reshaping a video, whose frames are a permuted view, one more)
        for image in (frame for clip in data for frame in clip) if media.kind == "video" else data:
            pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            buffer = io.BytesIO()
            Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="JPEG", quality=self.quality)
            sizes.append(buffer.tell() / 1000)
        size = torch.tensor(sizes, dtype=torch.float32).reshape(-1, frames).mean(dim=1)
        return {"score": self.sign * size, "size_kb": size}
