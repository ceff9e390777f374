"""The ShapesBench verifier as a reward: per-criterion checks of each image against its prompt (its record's
fields when it has them: colour, shape, count, relation, colour2, shape2; else its parsed text)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gyremedia.options import OptionError, option
from gyremedia.rollout import Media
from gyremedia_shapes.verifier import CRITERIA, verify_batch
from gyremedia_shapes.world import record_prompt


@dataclass
class ShapesVerifierOptions:
    partial_credit: bool = option(True, help="score = share of the prompt's criteria met; else 1 only if all are")
    # The criteria the score counts (the components report all of them): a subset makes a proxy whose
    # other criteria can serve as a held-out "gold" reward (monitor.gold).
    criteria: list[str] = option(default_factory=lambda: list(CRITERIA), help="the criteria the score counts")

    def validate(self) -> None:
        unknown = [c for c in self.criteria if c not in CRITERIA]
        if unknown or not self.criteria:
            raise OptionError("criteria", f"choose among {', '.join(CRITERIA)}")


class ShapesVerifierReward:
    """``score`` plus ``correct`` and one component per criterion.

    A criterion that does not apply to a prompt (position, for a prompt without a relation) is NaN in
    its component, so logged means are taken over the prompts it applies to.
    """

    kinds = {"image"}

    def __init__(self, options: ShapesVerifierOptions, context=None) -> None:
        self.partial_credit = options.partial_credit
        self.criteria = list(options.criteria)

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        images = media.data.detach().float().cpu().clamp(0, 1).permute(0, 2, 3, 1).numpy()
        results = verify_batch(images, [record_prompt(p) for p in prompts])
        out = {name: torch.tensor([float(r[name]) if name in r else np.nan for r in results]) for name in CRITERIA}
        out["correct"] = torch.tensor([float(r["correct"]) for r in results])
        counted = [[r[c] for c in self.criteria if c in r] for r in results]  # NaN where none applies
        combine = np.mean if self.partial_credit else np.all
        out["score"] = torch.tensor([float(combine(c)) if c else np.nan for c in counted], dtype=torch.float32)
        return out
