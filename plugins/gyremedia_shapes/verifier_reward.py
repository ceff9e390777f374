"""The ShapesBench verifier as a reward: per-criterion checks of each image against its prompt."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gyremedia.rollout import Media
from gyremedia_shapes.verifier import CRITERIA, verify


@dataclass
class ShapesVerifierOptions:
    partial_credit: bool = True  # score = share of the prompt's criteria met; else 1 only if all are


class ShapesVerifierReward:
    """``score`` plus ``correct`` and one component per criterion.

    A criterion that does not apply to a prompt (position, for a prompt without a relation) is NaN in
    its component, so logged means are taken over the prompts it applies to.
    """

    kinds = {"image"}

    def __init__(self, options: ShapesVerifierOptions, context=None) -> None:
        self.partial_credit = options.partial_credit

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        images = media.data.detach().float().cpu().clamp(0, 1).permute(0, 2, 3, 1).numpy()
        results = [verify(image, prompt) for image, prompt in zip(images, prompts)]
        out = {name: torch.tensor([float(r[name]) if name in r else np.nan for r in results]) for name in CRITERIA}
        out["correct"] = torch.tensor([float(r["correct"]) for r in results])
        if self.partial_credit:
            out["score"] = torch.tensor([np.mean([r[c] for c in CRITERIA if c in r]) for r in results], dtype=torch.float32)
        else:
            out["score"] = out["correct"].clone()
        return out
