"""The reward server's wire (lossless, no pickle) and its batching of requests that arrive together."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gyremedia.data import Prompt
from gyremedia.reward_server import RewardService, WireError, decode_batch, decode_scores, encode_batch, encode_scores
from gyremedia.rollout import Media


@pytest.mark.parametrize(
    "media",
    [
        Media("image", torch.rand(2, 3, 5, 7)),
        Media("video", torch.rand(2, 4, 3, 5, 5).to(torch.bfloat16), {"fps": 8}),
        Media("audio", torch.randn(2, 1, 99, dtype=torch.float64), {"sample_rate": 16000, "noise": torch.arange(3)}),
        Media("text", ["12+3=15", 'ünïcode \n and "quotes"']),
    ],
)
def test_media_and_records_cross_the_wire_exactly(media):
    prompts = [Prompt("two red circles", {"tag": "counting", "include": [{"class": "circle", "count": 2}]}), "plain"]
    received, records = decode_batch(encode_batch(media, prompts))
    assert received.kind == media.kind and received.meta.keys() == media.meta.keys()
    if media.kind == "text":
        assert received.data == media.data
    else:  # bit for bit, in its own dtype
        assert received.data.dtype == media.data.dtype and torch.equal(received.data, media.data)
    for key, value in media.meta.items():
        assert (
            torch.equal(received.meta[key], value) if isinstance(value, torch.Tensor) else received.meta[key] == value
        )
    assert records == prompts and [dict(r.fields) for r in records] == [dict(prompts[0].fields), {}]
    scores = {"score": torch.tensor([0.1, float("nan")]), "correct": torch.tensor([1.0, 0.0])}
    back = decode_scores(encode_scores(scores))
    assert torch.equal(back["correct"], scores["correct"]) and back["score"][0] == scores["score"][0]
    assert back["score"][1].isnan()


def test_what_cannot_cross_is_refused_with_its_reason():
    with pytest.raises(WireError, match="prompt records' fields cannot cross the wire as JSON"):
        encode_batch(Media("image", torch.rand(1, 3, 2, 2)), [Prompt("a", {"when": object()})])
    with pytest.raises(WireError, match="not a safetensors document"):
        decode_batch(b"\x80\x04 a pickle, say")
    with pytest.raises(WireError, match="not a scoring request"):
        decode_batch(encode_scores({"score": torch.zeros(2)}))


class Counting:
    """Scores each image by its mean and records the size of every call."""

    kinds = {"image"}

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        self.calls.append(len(prompts))
        return {"score": media.data.mean(dim=(1, 2, 3)), "length": torch.tensor([float(len(p)) for p in prompts])}


def test_requests_that_arrive_together_are_scored_together_and_split_back():
    reward = Counting()
    service = RewardService("counting", reward, max_batch=5, batch_wait=0.05)
    batches = [torch.rand(2, 3, 4, 4), torch.rand(3, 3, 4, 4), torch.rand(2, 3, 4, 4), torch.rand(1, 3, 8, 8)]

    async def together():
        return await asyncio.gather(
            *(service.score(Media("image", b), ["p" * (i + 1)] * len(b)) for i, b in enumerate(batches))
        )

    answers = asyncio.run(together())
    # 2 + 3 fill one call of max_batch 5; the next 2 wait alone; the 8x8 images cannot join 4x4 ones
    assert reward.calls == [5, 2, 1]
    for i, (images, answer) in enumerate(zip(batches, answers)):
        assert torch.allclose(answer["score"], images.mean(dim=(1, 2, 3)))
        assert answer["length"].tolist() == [i + 1.0] * len(images)
    assert service.health()["metrics"] == ["counting/length", "counting/score"]


SERVING_ONLY = """
import importlib.abc, sys

class TrainerStack(importlib.abc.MetaPathFinder):  # what a reward's own old environment may not have, or pin otherwise
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in {"diffusers", "transformers", "accelerate", "peft", "open_clip", "torchvision",
                                      "matplotlib", "tqdm", "datasets", "trl"}:
            raise ImportError(f"{name} is not installed here")

sys.meta_path.insert(0, TrainerStack())
import torch
from gyremedia.config import select_component
from gyremedia.interfaces import BuildContext
from gyremedia.plugins import PluginManager
from gyremedia.reward_server import RewardService, build_app

pm = PluginManager()
selected = select_component(pm, "reward", {"name": "shapes_verifier"}, "reward")
build_app(RewardService(selected.name, pm.build(selected, BuildContext(device=torch.device("cpu")))))
print("served without", sorted(m for m in sys.modules if m.partition(".")[0] in {"diffusers", "transformers"}))
"""


def test_serving_needs_none_of_the_trainers_stack():
    """What serve-requirements.txt installs beside a reward's own stack (torch, numpy, scipy, pillow) serves a reward."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SERVING_ONLY], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "served without []" in done.stdout, done.stderr[-3000:]
