"""The GenEval reward's rules on synthetic detections, against GenEval's evaluate_images.py (``evaluate``,
``relative_position``, the per-class filter of ``evaluate_image``) and Flow-GRPO's reward server
(``evaluate_reward``), its reading of GenEval metadata from prompt records, and the plumbing of its models on tiny
random-weight replicas built offline (a random detector's detections prove nothing about the rules)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gyremedia.data import Prompt, read_prompts
from gyremedia.options import validate
from gyremedia.rollout import Media
from gyremedia.scoring import call_reward
from gyremedia_rewards.geneval import (
    CLASSES,
    COLORS,
    TAGS,
    ClipColours,
    Detection,
    Detector,
    GenEval,
    GenEvalOptions,
    box_iou,
    check,
    check_partial,
    confidence_threshold,
    geneval_class,
    geneval_metadata,
    judge,
    keep_detections,
    mask_boxes,
    relative_position,
)


def det(label: str, box: tuple[float, float, float, float], score: float = 0.95) -> Detection:
    return Detection(label, box, score)


def no_colours(found, name):
    raise AssertionError("no clause here needs a colour")


class Colours:
    """A stub colour classifier: each box's colour from a table; records what it was asked."""

    def __init__(self, table: dict[tuple, str]) -> None:
        self.table, self.asked = table, []

    def __call__(self, found, name):
        self.asked.append((name, [d.box for d in found]))
        return [self.table[d.box] for d in found]


def meta(tag: str, include: list[dict], exclude: list[dict] | None = None) -> dict:
    return {"tag": tag, "include": include, **({"exclude": exclude} if exclude else {})}


# -- the filter -----------------------------------------------------------------------------------------------------


def test_iou_counts_pixels_inclusively_like_genevals_compute_iou():
    assert box_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0
    assert box_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)  # 5 x 10 shared of 100 + 100 - 50
    assert box_iou((0, 0, 9, 9), (20, 20, 29, 29)) == 0.0


def test_the_confidence_threshold_is_0_3_and_0_9_for_counting_prompts():
    assert confidence_threshold("counting") == 0.9
    assert all(confidence_threshold(tag) == 0.3 for tag in TAGS if tag != "counting")


def test_keep_detections_thresholds_sorts_caps_and_suppresses_per_class():
    low, tie, mid, high = (
        det("cat", (0, 0, 9, 9), 0.2),
        det("cat", (50, 0, 59, 9), 0.3),
        det("cat", (20, 0, 29, 9), 0.31),
        det("cat", (40, 0, 49, 9), 0.95),
    )
    kept = keep_detections([low, tie, mid, high, det("dog", (0, 0, 9, 9), 0.1)], threshold=0.3)
    assert kept == {"cat": [high, mid]}  # strictly above the threshold, most confident first; no empty classes
    three = [det("cat", (i * 20, 0, i * 20 + 9, 9), 0.9 - i / 100) for i in range(3)]
    assert keep_detections(three, 0.3, max_objects=2)["cat"] == three[:2]
    a, b = det("cat", (0, 0, 99, 99), 0.9), det("cat", (5, 5, 99, 99), 0.8)  # IoU ~0.9
    dog = det("dog", (0, 0, 99, 99), 0.7)
    assert keep_detections([a, b, dog], 0.3) == {"cat": [a, b], "dog": [dog]}  # GenEval's default: no suppression
    assert keep_detections([b, a, dog], 0.3, max_overlap=0.5) == {"cat": [a], "dog": [dog]}  # per class only


# -- positions ------------------------------------------------------------------------------------------------------


def test_relative_positions():
    left, right = (0, 40, 20, 60), (80, 40, 100, 60)
    top, bottom = (40, 0, 60, 20), (40, 80, 60, 100)
    assert relative_position(left, right) == {"left of"} and relative_position(right, left) == {"right of"}
    assert relative_position(top, bottom) == {"above"} and relative_position(bottom, top) == {"below"}
    assert relative_position((0, 0, 20, 20), (80, 80, 100, 100)) == {"left of", "above"}  # a clear diagonal
    assert relative_position((0, 50, 20, 70), (60, 40, 80, 60)) == {"left of"}  # mostly sideways


def test_ambiguous_positions_have_no_relation():
    # the centres are 10 apart but the margin is 0.1 x (100 + 100) = 20: nothing is left of anything
    assert relative_position((0, 0, 100, 100), (10, 0, 110, 100)) == set()
    # 30 apart clears the margin by 10, a third of the offset, under GenEval's half
    assert relative_position((0, 0, 100, 100), (30, 0, 130, 100)) == set()
    assert relative_position((0, 0, 100, 100), (30, 0, 130, 100), margin=0.0) == {"left of"}


# -- the verdicts ---------------------------------------------------------------------------------------------------


def verdict(metadata, detections, colour_of=no_colours, **options):
    return judge(metadata, detections, colour_of, **options)


def test_single_and_two_objects():
    one = meta("single_object", [{"class": "cat", "count": 1}])
    v = verdict(one, [det("cat", (0, 0, 9, 9))])
    assert (v.correct, v.strict_correct, v.partial, v.reason) == (True, True, 1.0, "")
    v = verdict(one, [det("dog", (0, 0, 9, 9)), det("cat", (20, 0, 29, 9), 0.25)])  # the cat is below 0.3
    assert (v.correct, v.strict_correct, v.partial) == (False, False, 0.0) and v.reason == "expected cat>=1, found 0"
    two = meta("two_object", [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}])
    assert verdict(two, [det("cat", (0, 0, 9, 9)), det("dog", (20, 0, 29, 9))]).correct
    v = verdict(two, [det("cat", (0, 0, 9, 9))])
    assert not v.correct and v.partial == 0.5 and "expected dog>=1, found 0" in v.reason


def buses(n: int, score: float = 0.95) -> list[Detection]:
    return [det("bus", (i * 30, 0, i * 30 + 19, 19), score) for i in range(n)]


def test_counting_wants_exactly_the_count():
    three = meta("counting", [{"class": "bus", "count": 3}], [{"class": "bus", "count": 4}])
    v = verdict(three, buses(3))
    assert (v.correct, v.strict_correct, v.partial) == (True, True, 1.0)
    v = verdict(three, buses(2))
    assert (v.correct, v.strict_correct) == (False, False) and v.partial == pytest.approx(2 / 3)
    assert v.reason == "expected bus>=3, found 2"
    v = verdict(three, buses(4))  # enough for include, but the exclude clause says fewer than 4
    assert (v.correct, v.strict_correct) == (False, False) and v.partial == pytest.approx(2 / 3)
    assert v.reason == "expected bus<4, found 4"
    # counting prompts count only detections above 0.9: a fourth bus at 0.85 does not count
    assert verdict(three, [*buses(3), det("bus", (200, 0, 219, 19), 0.85)]).correct
    # Flow-GRPO's count term is 1 - |count - found| / count, unclipped: far too many goes negative
    assert verdict(meta("counting", [{"class": "bus", "count": 1}]), buses(3)).partial == -1.0


def test_counting_with_suppression_of_a_duplicate_box():
    three = meta("counting", [{"class": "bus", "count": 3}], [{"class": "bus", "count": 4}])
    duplicate = det("bus", (1, 1, 20, 20), 0.93)  # the first bus again, IoU ~0.8
    assert not verdict(three, [*buses(3), duplicate]).correct  # GenEval's default keeps overlapping boxes
    v = verdict(three, [*buses(3), duplicate], max_overlap=0.5)
    assert (v.correct, v.strict_correct, v.partial) == (True, True, 1.0)


def test_colours():
    red_car = meta("colors", [{"class": "car", "count": 1, "color": "red"}])
    colours = Colours({(0, 0, 9, 9): "red", (20, 0, 29, 9): "blue"})
    v = verdict(red_car, [det("car", (0, 0, 9, 9))], colours)
    assert (v.correct, v.strict_correct, v.partial) == (True, True, 1.0)
    assert colours.asked == [("car", [(0, 0, 9, 9)])]  # asked once for both verdicts
    v = verdict(red_car, [det("car", (20, 0, 29, 9))], colours)
    assert (v.correct, v.strict_correct, v.partial) == (False, False, 0.5)
    assert v.reason == "expected red car>=1, found 0 red; and 1 blue"
    # GenEval checks only the most confident `count` cars; Flow-GRPO wants exactly `count` and adds a 0 for colour
    colours.asked.clear()
    v = verdict(red_car, [det("car", (0, 0, 9, 9), 0.9), det("car", (20, 0, 29, 9), 0.8)], colours)
    assert (v.correct, v.strict_correct, v.partial) == (True, False, 0.0)
    assert colours.asked == [("car", [(0, 0, 9, 9)])]
    attr = meta(
        "color_attr", [{"class": "car", "count": 1, "color": "red"}, {"class": "bus", "count": 1, "color": "red"}]
    )
    v = verdict(attr, [det("car", (0, 0, 9, 9)), det("bus", (20, 0, 29, 9))], colours)
    assert (v.correct, v.partial) == (False, 0.75) and v.reason.startswith("expected red bus>=1")


def test_positions():
    bird_left = meta(
        "position", [{"class": "couch", "count": 1}, {"class": "bird", "count": 1, "position": ["left of", 0]}]
    )
    couch = det("couch", (40, 40, 60, 60))
    v = verdict(bird_left, [couch, det("bird", (0, 40, 20, 60))])
    assert (v.correct, v.strict_correct, v.partial) == (True, True, 1.0)
    v = verdict(bird_left, [couch, det("bird", (80, 40, 100, 60))])
    assert (v.correct, v.strict_correct) == (
        False,
        False,
    ) and v.reason == "expected bird left of target, found right of target"
    assert v.partial == 0.75  # terms 1, 1, 0 and the 1 Flow-GRPO's server appends after a failed position
    v = verdict(bird_left, [couch, det("bird", (35, 40, 55, 60))])  # overlapping: ambiguous, so not left of
    assert not v.correct and v.reason == "expected bird left of target, found  target"
    v = verdict(bird_left, [det("bird", (0, 40, 20, 60))])  # no couch: no target
    assert not v.correct and "no target for bird to be left of" in v.reason
    assert v.partial == pytest.approx(1 / 3)  # couch count 0, bird count 1, position 0


def test_exclude_clauses_fail_genevals_verdict_only():
    cat_no_dog = meta("single_object", [{"class": "cat", "count": 1}], [{"class": "dog", "count": 1}])
    v = verdict(cat_no_dog, [det("cat", (0, 0, 9, 9)), det("dog", (20, 0, 29, 9))])
    assert not v.correct and v.reason == "expected dog<1, found 1"
    assert v.strict_correct and v.partial == 1.0  # Flow-GRPO's evaluate_reward does not read exclude
    assert verdict(cat_no_dog, [det("cat", (0, 0, 9, 9)), det("dog", (20, 0, 29, 9), 0.2)]).correct


def test_check_and_check_partial_take_kept_detections():
    objects = {"cat": [det("cat", (0, 0, 9, 9))]}
    assert check(meta("single_object", [{"class": "cat", "count": 1}]), objects, no_colours) == (True, "")
    assert check_partial(meta("single_object", [{"class": "cat", "count": 2}]), objects, no_colours) == (
        False,
        0.5,
        "expected cat==2, found 1",
    )


# -- metadata -------------------------------------------------------------------------------------------------------


def test_metadata_from_prompt_records():
    position = {
        "tag": "position",
        "include": [{"class": "couch", "count": 1}, {"class": "bird", "count": 1, "position": ["left of", 0]}],
    }
    expected = {
        "tag": "position",
        "exclude": [],
        "include": [{"class": "couch", "count": 1}, {"class": "bird", "count": 1, "position": ("left of", 0)}],
    }
    assert geneval_metadata(Prompt("a photo of a bird left of a couch", position)) == expected
    # as Hugging Face datasets reads a jsonl: missing keys filled with None
    filled = {
        "tag": "position",
        "exclude": None,
        "include": [
            {"class": "couch", "count": 1, "color": None, "position": None},
            {"class": "bird", "count": 1, "color": None, "position": ["left of", 0]},
        ],
    }
    assert geneval_metadata(Prompt("a photo of a bird left of a couch", filled)) == expected
    assert geneval_metadata(Prompt("p", {"metadata": json.dumps(position)})) == expected  # the line in one field


def test_a_prompt_without_metadata_says_how_to_give_it():
    with pytest.raises(
        ValueError,
        match=r"prompt 'a cat' has no 'tag' or 'include' field \(its fields: none\).*"
        r"data.prompts_file.*evaluation_metadata.jsonl",
    ):
        geneval_metadata("a cat")
    with pytest.raises(ValueError, match=r"no 'include' field \(its fields: 'tag'\)"):
        geneval_metadata(Prompt("a cat", {"tag": "single_object"}))
    with pytest.raises(ValueError, match="'unicorn' is not one of GenEval's 80 COCO classes"):
        geneval_metadata(Prompt("p", {"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}))
    with pytest.raises(ValueError, match="index of an earlier include clause"):
        geneval_metadata(
            Prompt("p", {"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["left of", 0]}]})
        )


# -- the reward -----------------------------------------------------------------------------------------------------

RECORDS = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {
        "tag": "counting",
        "include": [{"class": "bus", "count": 3}],
        "exclude": [{"class": "bus", "count": 4}],
        "prompt": "a photo of three buses",
    },
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    {
        "tag": "position",
        "include": [{"class": "couch", "count": 1}, {"class": "bird", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a bird left of a couch",
    },
]

#: What the stub detector sees in image i (each image is filled with the value i).
SCENES = [
    [det("bench", (0, 0, 9, 9))],  # right
    buses(4),  # one bus too many
    [det("car", (0, 0, 9, 9))],  # a blue car
    [det("couch", (40, 40, 60, 60)), det("bird", (80, 40, 100, 60))],  # bird right of the couch
]


class StubDetector:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, images: np.ndarray) -> list[list[Detection]]:
        assert images.dtype == np.uint8 and images.ndim == 4 and images.shape[-1] == 3
        self.calls += 1
        return [SCENES[int(image[0, 0, 0])] for image in images]


def stub_colours(image: np.ndarray, detections, classname: str) -> list[str]:
    assert image.dtype == np.uint8 and image.shape == (24, 32, 3) and classname == "car"
    return ["blue" for _ in detections]


@pytest.fixture
def prompts(tmp_path) -> list[Prompt]:
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return read_prompts(str(path))  # as data.prompts_file reads them


def media() -> Media:
    return Media("image", torch.arange(4.0).view(4, 1, 1, 1).expand(4, 3, 24, 32) / 255)


def test_the_reward_reads_each_prompts_metadata_and_scores_flow_grpos_partial_reward(prompts):
    reward = GenEval(GenEvalOptions(batch_size=3), detector=StubDetector(), colours=stub_colours)
    out = call_reward(reward, media(), prompts)  # the core's call: chunks of batch_size, contract checked
    assert reward.detector.calls == 2
    assert out["correct"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out["strict_correct"].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(out["partial"], torch.tensor([1.0, 2 / 3, 0.5, 0.75]))
    torch.testing.assert_close(out["score"], out["partial"])
    assert all(v.dtype == torch.float32 and v.shape == (4,) for v in out.values())
    assert out["correct_single_object"][0] == 1.0 and out["correct_counting"][1] == 0.0
    assert math.isnan(out["correct_single_object"][1]) and out["correct_two_object"].isnan().all()
    strict = GenEval(GenEvalOptions(score="correct"), detector=StubDetector(), colours=stub_colours)
    assert strict(media(), prompts)["score"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_the_reward_fails_before_detecting_when_a_prompt_has_no_metadata(prompts):
    reward = GenEval(GenEvalOptions(), detector=StubDetector(), colours=stub_colours)
    with pytest.raises(ValueError, match="prompt 'a red car' has no 'tag' or 'include' field"):
        reward(media(), [*prompts[:3], "a red car"])
    assert reward.detector.calls == 0


# -- the models' plumbing -------------------------------------------------------------------------------------------

#: COCO's label map as detectors spell it (mouse, remote, keyboard: GenEval renames them).
COCO = [{"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}.get(c, c) for c in CLASSES]


def test_detector_labels_map_to_genevals_names():
    assert [geneval_class(c) for c in COCO] == list(CLASSES)
    assert geneval_class("motorbike") == "motorcycle" and geneval_class("Potted_Plant") == "potted plant"
    assert geneval_class("wall-other-merged") is None


def test_mask_boxes_are_mmdetections_mask2bbox():
    masks = torch.zeros(2, 6, 8, dtype=torch.bool)
    masks[0, 1:3, 2:5] = True
    assert mask_boxes(masks).tolist() == [[2, 1, 5, 3], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def tiny_mask2former(tmp_path_factory):
    """A random Mask2Former (a 4-stage Swin of width 8, 6 queries, COCO's 80 labels) and its processor, saved."""
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    swin = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(
        backbone_config=swin,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        num_queries=6,
        id2label=dict(enumerate(COCO)),
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mask2former")
    Mask2FormerForUniversalSegmentation(config).save_pretrained(folder)
    Mask2FormerImageProcessor().save_pretrained(folder)
    return folder


def test_the_detector_returns_detections_of_the_images_size(tiny_mask2former):
    detector = Detector(str(tiny_mask2former), short_edge=64, long_edge=128)
    assert detector.input_size(40, 48) == (64, 77)  # padded to 64 x 96 for the model
    images = np.random.default_rng(0).integers(0, 256, (2, 40, 48, 3), dtype=np.uint8)
    found = detector(images)
    assert len(found) == 2 and all(found)
    for detection in (d for image in found for d in image):
        assert detection.label in CLASSES and 0 < detection.score <= 1
        assert detection.mask.shape == (40, 48) and detection.mask.dtype == bool
        assert list(detection.box) == mask_boxes(torch.from_numpy(detection.mask)[None])[0].tolist()
    assert len(found[0]) <= 6 * 80 and detector(images[:0]) == []
    picky = Detector(str(tiny_mask2former), short_edge=64, long_edge=128, min_score=0.5)
    assert picky(images) == [[], []]  # random weights: no class probability near 0.5 among 81


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> str:
    """A random open_clip model's config json (widths 64 and 32, one layer each)."""
    config = tmp_path_factory.mktemp("clip") / "tiny-geneval-clip.json"
    config.write_text(
        json.dumps(
            {
                "embed_dim": 16,
                "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8},
                "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
            }
        )
    )
    return str(config)


def test_clip_colours_crop_mask_and_name_a_colour_per_object(tiny_clip):
    torch.manual_seed(0)
    colours = ClipColours(tiny_clip, pretrained=None)
    image = np.zeros((20, 30, 3), dtype=np.uint8)
    image[:, :, 0] = 255
    mask = np.zeros((20, 30), dtype=bool)
    mask[5:10, 10:20] = True
    objects = [Detection("car", (8, 5, 20, 10), 0.9, mask), Detection("car", (0, 0, 30, 20), 0.9)]
    masked, whole = ClipColours.crops(image, objects)
    assert masked.size == (12, 5) and whole.size == (30, 20)
    assert masked.getpixel((0, 0)) == (0x99, 0x99, 0x99) and masked.getpixel((2, 0)) == (255, 0, 0)
    head = colours.head("car")
    assert head.shape == (16, len(COLORS)) and torch.allclose(head.norm(dim=0), torch.ones(len(COLORS)))
    names = colours(image, objects, "car")
    assert len(names) == 2 and set(names) <= set(COLORS)


def test_the_reward_runs_on_its_own_models(tiny_mask2former, tiny_clip, prompts):
    torch.manual_seed(0)
    options = GenEvalOptions(
        detector=str(tiny_mask2former),
        short_edge=64,
        long_edge=128,
        clip_model=tiny_clip,
        clip_pretrained="",
        threshold=0.0,
        counting_threshold=0.0,
    )
    assert validate(options) == []
    reward, asked = GenEval(options), []
    clip = reward.colours
    reward.colours = lambda image, objects, name: asked.append(name) or clip(image, objects, name)
    out = reward(Media("image", torch.rand(4, 3, 24, 32, generator=torch.Generator().manual_seed(0))), prompts)
    assert asked == ["car"]  # at threshold 0 the random detector finds a car for the red-car prompt
    assert all(v.shape == (4,) and v.dtype == torch.float32 for v in out.values())
    assert set(out["correct"].tolist()) <= {0.0, 1.0} and torch.isfinite(out["score"]).all()
