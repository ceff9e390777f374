"""ShapesBench: prompt grammar and split, renderer, and the verifier reward on real renders."""

import numpy as np
import pytest
import torch

from gyremedia.options import validate
from gyremedia.rollout import Media
from gyremedia_shapes.verifier import detect, detect_batch, verify
from gyremedia_shapes.verifier_reward import ShapesVerifierOptions, ShapesVerifierReward
from gyremedia_shapes.world import VOCABULARY, all_prompts, parse_prompt, render, render_batch, split_prompts


def test_prompts_parse_back_and_use_only_the_vocabulary():
    prompts = all_prompts()
    assert len(prompts) == 27 + 4 * 54
    for prompt in prompts:
        assert parse_prompt(prompt.text) == prompt
        assert set(prompt.text.split()) <= set(VOCABULARY)
    with pytest.raises(ValueError, match="not a ShapesBench prompt"):
        parse_prompt("a purple hexagon")
    with pytest.raises(ValueError, match="different colours"):
        parse_prompt("a red circle left of a red square")


def test_split_is_disjoint_and_holds_out_unseen_combinations_of_seen_words():
    train, heldout = split_prompts(seed=0)
    assert not set(train) & set(heldout)
    assert len(train) + len(heldout) == len(all_prompts())
    assert any(" of " in p or "above" in p or "below" in p for p in heldout)
    assert any(p.startswith(("two", "three")) for p in heldout)
    assert set(" ".join(heldout).split()) <= set(" ".join(train).split())
    assert split_prompts(seed=0) == (train, heldout)


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_verifier_accepts_every_render_of_every_prompt(noise):
    rng = np.random.default_rng(0)
    for prompt in all_prompts():
        for _ in range(3):
            image = np.clip(render(prompt, rng) + rng.normal(0, noise, (16, 16, 3)), 0, 1)
            result = verify(image, prompt)
            assert result["correct"], (prompt.text, result, detect(image))


def test_a_batch_is_detected_as_its_images_are_one_by_one():
    """One labelling call over the batch's colour planes joins no components across images or colours."""
    rng = np.random.default_rng(3)
    images = np.concatenate([np.stack([render(p, rng) for p in all_prompts()[:8]]), rng.random((8, 16, 16, 3))])
    batch = detect_batch(images)
    assert batch == [detect(image) for image in images]
    assert sum(len(objects) for objects in batch[8:]) > 8  # noise: many components, touching every edge
    assert detect_batch(np.zeros((2, 16, 16, 3))) == [[], []]


def test_verifier_names_the_failed_criterion():
    rng = np.random.default_rng(1)
    image = render("a red circle left of a blue square", rng)
    assert verify(image, "a blue circle left of a red square") == {
        "object": True,
        "colour": False,
        "count": False,
        "position": False,
        "correct": False,
    }
    assert verify(image, "a red circle right of a blue square")["position"] is False
    assert verify(image, "a red circle right of a blue square")["colour"] is True
    two = render("two green triangles", rng)
    assert verify(two, "three green triangles") == {"object": True, "colour": True, "count": False, "correct": False}
    assert verify(np.zeros((16, 16, 3)), "a red square")["object"] is False


def test_reward_scores_partial_credit_per_criterion():
    rng = np.random.default_rng(2)
    prompts = ["a red circle left of a blue square", "two green triangles"]
    images = torch.from_numpy(render_batch(prompts, rng))
    reward = ShapesVerifierReward(ShapesVerifierOptions())
    right = reward(Media("image", images), prompts)
    assert right["score"].tolist() == [1.0, 1.0] and right["correct"].tolist() == [1.0, 1.0]
    assert torch.isnan(right["position"][1])  # position does not apply to a count prompt
    wrong = reward(Media("image", images), ["a red circle right of a blue square", "three green triangles"])
    assert wrong["score"].tolist() == pytest.approx([0.75, 2 / 3])
    strict = ShapesVerifierReward(ShapesVerifierOptions(partial_credit=False))
    assert strict(Media("image", images), ["a red circle right of a blue square", "two green triangles"])[
        "score"
    ].tolist() == [0.0, 1.0]
    # a proxy counting some criteria only; a criterion that applies to no prompt criterion leaves NaN
    proxy = ShapesVerifierReward(ShapesVerifierOptions(criteria=["object", "colour"]))
    assert proxy(Media("image", images), ["a red circle right of a blue square", "three green triangles"])[
        "score"
    ].tolist() == [1.0, 1.0]
    position = ShapesVerifierReward(ShapesVerifierOptions(criteria=["position"]))(Media("image", images), prompts)[
        "score"
    ]
    assert position[0] == 1.0 and torch.isnan(position[1])
    assert "choose among object, colour, count, position" in validate(ShapesVerifierOptions(criteria=["size"]))[0]


def test_pretraining_builds_the_unet_depth_asked_for_and_refuses_it_for_the_flow_family():
    from gyremedia_shapes.pretrain import FAMILIES, DiffusionFamily, main

    shipped = FAMILIES["diffusion"].build(seed=0).unet
    deeper = DiffusionFamily(unet_channels=[32, 64, 64, 64]).build(seed=0).unet
    assert (len(shipped.down_blocks), len(deeper.down_blocks)) == (2, 4)
    assert list(deeper.config.block_out_channels) == [32, 64, 64, 64]
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--unet-channels", "32", "64"])


def test_the_high_noise_share_draws_its_timesteps_from_the_noisiest_levels():
    """What fixed the UNet base (docs/benchmarks.md, "Diffusion UNet"): part of each batch at the levels where the
    prompt alone decides the layout. A flow model's pretraining refuses the option."""
    from gyremedia_shapes.pretrain import HIGH_NOISE, DiffusionFamily, main

    family = DiffusionFamily("v_prediction", zero_terminal_snr=True, high_noise_share=1.0)
    pipe = family.build(seed=0)
    seen, forward = [], pipe.unet.forward
    pipe.unet.forward = lambda x, t, **kwargs: seen.append(t) or forward(x, t, **kwargs)
    family.loss(pipe, torch.zeros(64, 4, 16, 16), ["a red circle"] * 64, "uniform")
    assert seen[0].min() >= round(1000 * (1 - HIGH_NOISE)) and len(set(seen[0].tolist())) > 10
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--high-noise-share", "0.5"])


def test_the_reward_reads_a_records_fields_and_the_shipped_records_match_their_text():
    """A record's fields (GenEval-style metadata) are what the verifier checks, not its text; the quickstart's
    jsonl prompt sets hold each prompt's own parse."""
    import json
    from pathlib import Path

    from gyremedia.config import asset_path
    from gyremedia.data import Prompt
    from gyremedia_shapes.world import record

    image = render("a red circle", np.random.default_rng(0))
    reward = ShapesVerifierReward(ShapesVerifierOptions())
    media = Media("image", torch.from_numpy(image).permute(2, 0, 1)[None].float())
    as_text = reward(media, ["a red circle"])["correct"]
    contradicting = reward(media, [Prompt("a red circle", {"colour": "blue", "shape": "square", "count": 1})])
    assert as_text.item() == 1.0 and contradicting["correct"].item() == 0.0
    for name in ("train_prompts", "heldout_prompts"):
        lines = Path(asset_path(f"shapes16/{name}.jsonl")).read_text().splitlines()
        texts = Path(asset_path(f"shapes16/{name}.txt")).read_text().split("\n")
        assert [json.loads(line) for line in lines] == [record(t) for t in texts if t]
