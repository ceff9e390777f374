"""ImageReward, HPSv3 and VideoAlign run their own scoring code, which cannot install beside the trainer's stack:
these tests stand a module with each one's published API in for it (``ImageReward.load(...).score(prompt,
image)``; ``hpsv3.HPSv3RewardInferencer(...).reward(images, prompts)`` -> ``[B, 2]`` mean and spread;
VideoAlign's ``inference.VideoVLMRewardInference(...).reward(video_paths, prompts, use_norm=)`` -> dicts of VQ, MQ,
TA and Overall, reading MP4 files) and check what gyremedia hands it and takes back; without the code, building
the reward says where it runs."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from gyremedia.rollout import Media
from gyremedia_rewards.pinned import HPSv3, HPSv3Options, ImageReward, ImageRewardOptions, VideoAlign, VideoAlignOptions

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


@pytest.mark.parametrize(
    "reward, options, package", [(ImageReward, ImageRewardOptions, "image-reward"), (HPSv3, HPSv3Options, "hpsv3")]
)
def test_without_its_package_it_says_to_serve_it(monkeypatch, reward, options, package):
    monkeypatch.setitem(sys.modules, "ImageReward", None)
    monkeypatch.setitem(sys.modules, "hpsv3", None)
    with pytest.raises(
        ImportError, match=f"needs the {package} package.*pip install {package}.*gyremedia serve-reward"
    ):
        reward(options())


def test_videoalign_writes_each_clip_at_its_fps_and_sums_the_three_qualities(monkeypatch, tmp_path):
    written, seen = {}, {}

    def mimwrite(path, frames, fps):
        written[path] = (np.stack(frames), fps)

    class Inferencer:
        def __init__(self, load_from_pretrained, load_from_pretrained_step=-1, device="cuda", dtype=torch.bfloat16):
            seen["init"] = (load_from_pretrained, device, dtype)

        def reward(self, video_paths, prompts, fps=None, num_frames=None, max_pixels=None, use_norm=True):
            seen["use_norm"] = use_norm
            return [
                {
                    "VQ": float(written[p][0].mean()),
                    "MQ": 1.0,
                    "TA": float(len(t)),
                    "Overall": float(written[p][0].mean()) + 1.0 + len(t),
                }
                for p, t in zip(video_paths, prompts)
            ]

    monkeypatch.setitem(sys.modules, "imageio", types.SimpleNamespace(mimwrite=mimwrite))
    monkeypatch.setitem(sys.modules, "inference", types.SimpleNamespace(VideoVLMRewardInference=Inferencer))
    (tmp_path / "inference.py").write_text("")
    reward = VideoAlign(VideoAlignOptions(repository=str(tmp_path), checkpoint=str(tmp_path)))
    assert seen["init"] == (str(tmp_path), "cpu", torch.bfloat16)
    clips = torch.rand(2, 3, 3, 4, 5, generator=torch.Generator().manual_seed(0))  # [B, T, 3, H, W]
    out = reward(Media("video", clips, {"fps": 8}), PROMPTS)
    frames = [(clip * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy() for clip in clips]
    assert [f.shape for f, _ in written.values()] == [(3, 4, 5, 3)] * 2 and {fps for _, fps in written.values()} == {8}
    assert all(np.array_equal(f, expected) for (f, _), expected in zip(written.values(), frames))
    means = torch.tensor([float(f.mean()) for f in frames])
    assert torch.allclose(out["VQ"], means) and torch.allclose(out["score"], means + 1 + torch.tensor([12.0, 16.0]))
    assert seen["use_norm"] is True
