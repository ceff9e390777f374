"""An example third-party gyremedia plugin: the colourfulness reward of Hasler and Suesstrunk (2003).

Install it (``pip install ./examples/gyremedia-example-reward``) and select it in a yaml:

    rewards:
      - {name: colorfulness, weight: 1.0, saturation_only: false}
"""

from __future__ import annotations

from dataclasses import dataclass

from gyremedia import hookimpl


@dataclass
class ColorfulnessOptions:
    saturation_only: bool = False  # score only the mean chroma, ignoring its spread


class Colorfulness:
    """``sqrt(std_rg^2 + std_yb^2) + 0.3 sqrt(mean_rg^2 + mean_yb^2)`` on opponent colour axes, per image."""

    kinds = {"image"}

    def __init__(self, options: ColorfulnessOptions, context=None) -> None:
        self.saturation_only = options.saturation_only

    def __call__(self, media, prompts):
        r, g, b = (media.data.float() * 255).unbind(dim=1)
        rg, yb = r - g, 0.5 * (r + g) - b
        spread = (rg.flatten(1).std(1) ** 2 + yb.flatten(1).std(1) ** 2).sqrt()
        level = (rg.flatten(1).mean(1) ** 2 + yb.flatten(1).mean(1) ** 2).sqrt()
        score = 0.3 * level if self.saturation_only else spread + 0.3 * level
        return {"score": score / 100, "chroma": level}


@hookimpl
def gyremedia_register_rewards(register):
    register(
        "colorfulness",
        Colorfulness,
        options=ColorfulnessOptions,
        description="Hasler-Suesstrunk colourfulness (example third-party plugin)",
    )
