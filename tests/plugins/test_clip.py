"""CLIP rewards on a tiny open_clip model registered offline (a config json and a saved checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

from gyremedia.options import validate
from gyremedia.rollout import Media
from gyremedia.scoring import call_reward
from gyremedia_rewards.clip import ClipOptions, ClipScore, ClipSteering, ClipSteeringOptions

TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> ClipOptions:
    import open_clip

    folder = tmp_path_factory.mktemp("clip")
    config = folder / "tiny-test-clip.json"
    config.write_text(json.dumps(TINY_CLIP))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-test-clip")
    torch.save(model.state_dict(), folder / "tiny.pt")
    return ClipOptions(model=str(config), pretrained=str(folder / "tiny.pt"), batch_size=3)


def images(n: int) -> Media:
    return Media("image", torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(n)))


def test_clip_score_is_deterministic_and_batched_equals_unbatched(tiny_clip):
    reward = ClipScore(tiny_clip)
    media, prompts = images(7), ["a red circle", "a blue square", "two green triangles"] * 2 + ["a cat"]
    first = call_reward(reward, media, prompts)["score"]
    whole = ClipScore(ClipOptions(**{**tiny_clip.__dict__, "batch_size": 64}))
    torch.testing.assert_close(first, call_reward(whole, media, prompts)["score"], atol=1e-5, rtol=0)
    torch.testing.assert_close(first, call_reward(reward, media, prompts)["score"], atol=0, rtol=0)
    assert first.shape == (7,) and (first.abs() <= 1).all()


def test_clip_score_is_the_cosine_of_the_models_own_embeddings(tiny_clip):
    reward = ClipScore(tiny_clip)
    media, prompts = images(2), ["a red circle", "a blue square"]
    model = reward.encoder.model
    with torch.no_grad():
        text = torch.nn.functional.normalize(model.encode_text(reward.encoder.tokenizer(prompts)), dim=-1)
    image = reward.encoder.images(media.data)
    torch.testing.assert_close(reward(media, prompts)["score"], (image * text).sum(-1))
    # a different prompt gives a different score: the reward reads the text
    assert not torch.equal(reward(media, prompts)["score"], reward(media, prompts[::-1])["score"])


def test_steering_moves_the_target_toward_positive_and_away_from_negative(tiny_clip):
    options = ClipSteeringOptions(**tiny_clip.__dict__, positive=["a calm garden"], negative=["a burning car"])
    reward = ClipSteering(options)
    encoder = reward.encoder
    prompts = ["a street at night"]
    # An "image" whose embedding is exactly the positive text scores higher than one equal to the negative.
    positive, negative = encoder.texts(["a calm garden"]), encoder.texts(["a burning car"])
    target = torch.nn.functional.normalize(encoder.texts(prompts) + reward.direction, dim=-1)
    assert (positive * target).sum() > (negative * target).sum()
    scores = reward(images(1), prompts)
    assert set(scores) == {"score", "prompt_similarity", "positive_similarity", "negative_similarity"}
    assert torch.isfinite(scores["score"]).all()
    assert validate(ClipSteeringOptions(**tiny_clip.__dict__, negative=[]))[0] == "negative=[]: give at least one text"


def test_missing_weights_fail_with_the_fix(tiny_clip):
    assert "needs weights: a tag (e.g. openai)" in validate(ClipOptions(model=tiny_clip.model, pretrained=""))[0]
    assert "no such model-config file" in validate(ClipOptions(model="/nowhere/model.json"))[0]
