"""ImageReward and HPSv3 run their packages' own scoring code, which cannot install beside the trainer's stack:
these tests stand a module with each package's published API in for it (``ImageReward.load(...).score(prompt,
image)``; ``hpsv3.HPSv3RewardInferencer(...).reward(images, prompts)`` -> ``[B, 2]`` mean and spread) and check
what gyremedia hands it and takes back; without the package, building the reward says where it runs."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from gyremedia.rollout import Media
from gyremedia_rewards.pinned import HPSv3, HPSv3Options, ImageReward, ImageRewardOptions

PROMPTS = ["a red circle", "two blue squares"]


def images() -> torch.Tensor:
    return torch.rand(2, 3, 6, 5, generator=torch.Generator().manual_seed(0))


def eight_bit(picture) -> np.ndarray:
    return np.asarray(picture)


@pytest.fixture
def reference_packages(monkeypatch):
    """Stand-ins that score an image by its mean 8-bit red value plus the prompt's length, as the packages' API."""
    seen = {}

    class Scorer:
        def score(self, prompt, image):
            assert isinstance(prompt, str) and image.mode == "RGB"
            return float(eight_bit(image)[..., 0].mean() + len(prompt))

    def load(name, device, med_config=None):
        seen["load"] = (name, device, med_config)
        return Scorer()

    class Inferencer:
        def __init__(self, config_path=None, checkpoint_path=None, device="cuda", differentiable=False):
            seen["inferencer"] = (config_path, checkpoint_path, device)

        def reward(self, image_paths, prompts):
            mu = [eight_bit(i)[..., 0].mean() + len(p) for i, p in zip(image_paths, prompts)]
            return torch.tensor([[m, 0.5] for m in mu])

    monkeypatch.setitem(sys.modules, "ImageReward", types.SimpleNamespace(load=load))
    monkeypatch.setitem(sys.modules, "hpsv3", types.SimpleNamespace(HPSv3RewardInferencer=Inferencer))
    return seen


def expected() -> torch.Tensor:
    pixels = (images() * 255).round()
    return pixels[:, 0].mean(dim=(1, 2)) + torch.tensor([float(len(p)) for p in PROMPTS])


def test_image_reward_scores_each_8_bit_image_with_its_prompt(reference_packages):
    reward = ImageReward(ImageRewardOptions())
    assert reference_packages["load"] == ("ImageReward-v1.0", "cpu", None)
    assert torch.allclose(reward(Media("image", images()), PROMPTS)["score"], expected())


def test_hpsv3_takes_the_predicted_mean_as_the_score(reference_packages):
    out = HPSv3(HPSv3Options())(Media("image", images()), PROMPTS)
    assert reference_packages["inferencer"] == (None, None, "cpu")
    assert torch.allclose(out["score"], expected()) and out["sigma"].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("reward, options, package", [(ImageReward, ImageRewardOptions, "image-reward"),
                                                      (HPSv3, HPSv3Options, "hpsv3")])
def test_without_its_package_it_says_to_serve_it(monkeypatch, reward, options, package):
    monkeypatch.setitem(sys.modules, "ImageReward", None)
    monkeypatch.setitem(sys.modules, "hpsv3", None)
    with pytest.raises(ImportError, match=f"needs the {package} package.*gyremedia serve-reward"):
        reward(options())
