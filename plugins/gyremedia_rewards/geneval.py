"""GenEval reward (Ghosh et al. 2023): does the image hold the objects, counts, colours and positions its prompt's
GenEval metadata asks for?

Each prompt is a record of a GenEval metadata file (GenEval's ``prompts/evaluation_metadata.jsonl``, Flow-GRPO's
``dataset/geneval/{train,test}_metadata.jsonl``): ``tag`` (single_object, two_object, counting, colors, position,
color_attr), ``include`` (``[{class, count, color?, position?: [relation, index]}]``), optionally ``exclude``
(``[{class, count}]``), and the prompt text. An instance segmenter (Mask2Former on COCO, GenEval's detector) finds
the objects; CLIP names the colour of each object it must check; the rules below judge them as GenEval's
``evaluation/evaluate_images.py`` does, and as Flow-GRPO's reward server (yifan123/reward-server,
``reward_server/gen_eval.py``) scores them for training:

- ``correct``: GenEval's verdict (``evaluate``): every ``include`` has at least ``count`` objects of its class (its
  most confident ``count`` then checked for colour and position), every ``exclude`` fewer than ``count``;
- ``strict_correct``: Flow-GRPO's strict verdict (``evaluate_reward``): every ``include`` has exactly ``count``
  objects and the colour and position checks pass; ``exclude`` is not read (for counting prompts the exact count
  already implies it);
- ``partial``: Flow-GRPO's training reward (``evaluate_reward``'s ``score``, what its GRPO trains on): the mean of
  one term per check, ``1 - |count - found| / count`` for each count and colour, 1/0 for each position; it can be
  negative (far too many objects) and keeps the server's quirk of also adding a 1 after a failed position check.

``score`` is ``partial`` by default (``score: correct`` or ``strict`` picks the others); ``correct_<tag>`` is
``correct`` for the samples of that tag and NaN for the rest (GenEval's per-task accuracy).

Detections are filtered as GenEval does before judging: per class, a confidence above ``threshold`` (0.3; 0.9 for
counting prompts), the 16 most confident, then non-maximum suppression at IoU ``max_overlap`` (1.0, GenEval's
default: no suppression). GenEval's detector is mmdetection's Mask2Former Swin-S COCO instance model; here it is
transformers' ``Mask2FormerForUniversalSegmentation`` (default ``facebook/mask2former-swin-small-coco-instance``, the
original Mask2Former authors' Swin-S weights, not mmdetection's retrained ones), run at mmdetection's test scale
(shortest edge 800, longest at most 1333) and post-processed as mmdetection 2.x's ``MaskFormerFusionHead`` (100
top (query, class) pairs, masks at logit > 0, score = class probability x mean mask probability, boxes from masks).
Images are quantised to 8 bits as Flow-GRPO does (it also JPEG-compresses them for its server; that is not done).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from gyremedia.data import prompt_fields
from gyremedia.interfaces import BuildContext
from gyremedia.media_io import eight_bit
from gyremedia.options import option, pretrained_source
from gyremedia.rollout import Media
from gyremedia_rewards.preference import reward_device

#: GenEval's colour list (``COLORS`` in evaluate_images.py), in its order (argmax ties go to the first).
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")

#: GenEval's class names (``evaluation/object_names.txt``): the 80 COCO classes in COCO's order, with three renamed.
CLASSES = (
    "person",
    "bicycle",
    "car",
    "motorcycle",
    "airplane",
    "bus",
    "train",
    "truck",
    "boat",
    "traffic light",
    "fire hydrant",
    "stop sign",
    "parking meter",
    "bench",
    "bird",
    "cat",
    "dog",
    "horse",
    "sheep",
    "cow",
    "elephant",
    "bear",
    "zebra",
    "giraffe",
    "backpack",
    "umbrella",
    "handbag",
    "tie",
    "suitcase",
    "frisbee",
    "skis",
    "snowboard",
    "sports ball",
    "kite",
    "baseball bat",
    "baseball glove",
    "skateboard",
    "surfboard",
    "tennis racket",
    "bottle",
    "wine glass",
    "cup",
    "fork",
    "knife",
    "spoon",
    "bowl",
    "banana",
    "apple",
    "sandwich",
    "orange",
    "broccoli",
    "carrot",
    "hot dog",
    "pizza",
    "donut",
    "cake",
    "chair",
    "couch",
    "potted plant",
    "bed",
    "dining table",
    "toilet",
    "tv",
    "laptop",
    "computer mouse",
    "tv remote",
    "computer keyboard",
    "cell phone",
    "microwave",
    "oven",
    "toaster",
    "sink",
    "refrigerator",
    "book",
    "clock",
    "vase",
    "scissors",
    "teddy bear",
    "hair drier",
    "toothbrush",
)

#: Other spellings of GenEval's classes in detectors' label maps (COCO's own and PASCAL VOC's).
LABEL_ALIASES = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",  # COCO's names
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "tvmonitor": "tv",
    "television": "tv",
    "hairdryer": "hair drier",
    "doughnut": "donut",
    "mobilephone": "cell phone",
    "diningtable": "dining table",
}

#: The tags of GenEval's six tasks.
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

#: The relations a ``position`` clause may ask for (``relative_position`` in evaluate_images.py).
RELATIONS = ("left of", "right of", "above", "below")

#: GenEval's zero-shot colour prompts (``color_classification``), averaged per colour.
COLOUR_TEMPLATES = (
    "a photo of a {color} {object}",
    "a photo of a {color}-colored {object}",
    "a photo of a {color} object",
)

#: What GenEval paints outside an object's mask before cropping it for CLIP (its ``bgcolor`` default).
BACKGROUND = "#999"


@dataclass(eq=False)
class Detection:
    """One detected object: GenEval class name, ``box`` (x1, y1, x2, y2) in pixels, confidence, optional mask."""

    label: str
    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None  # bool [H, W]


#: The rules' colour source: the colour name of each of ``detections`` (all of class ``classname``).
ColourOf = Callable[[Sequence[Detection], str], list[str]]


@dataclass
class Verdict:
    """One image's judgement: GenEval's ``correct`` and Flow-GRPO's ``strict_correct`` and ``partial`` score."""

    correct: bool
    strict_correct: bool
    partial: float
    reason: str  # why it is not correct (GenEval's rules); empty when it is
    strict_reason: str  # why it is not strictly correct (Flow-GRPO's rules)


# -- the rules, on detections ---------------------------------------------------------------------------------------


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two xyxy boxes counting pixels inclusively (width ``x2 - x1 + 1``), as ``compute_iou`` in GenEval's
    evaluate_images.py."""

    def area(box: Sequence[float]) -> float:
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def confidence_threshold(tag: str | None, threshold: float = 0.3, counting_threshold: float = 0.9) -> float:
    """The confidence a detection must exceed: ``counting_threshold`` for counting prompts, else ``threshold``
    (``evaluate_image`` in GenEval's evaluate_images.py: 0.3 and 0.9)."""
    return counting_threshold if tag == "counting" else threshold


def keep_detections(
    detections: Sequence[Detection], threshold: float, max_objects: int = 16, max_overlap: float = 1.0
) -> dict[str, list[Detection]]:
    """The detections GenEval judges, per class, most confident first (``evaluate_image`` in evaluate_images.py):
    confidence strictly above ``threshold``, the ``max_objects`` most confident, then greedy non-maximum suppression
    within the class, dropping a box whose :func:`box_iou` with a kept one is ``max_overlap`` or more (1: keep all,
    GenEval's default). Classes with nothing left are absent."""
    by_class: dict[str, list[Detection]] = {}
    for detection in detections:
        if detection.score > threshold:
            by_class.setdefault(detection.label, []).append(detection)
    kept = {}
    for label, found in by_class.items():
        candidates = sorted(found, key=lambda d: d.score, reverse=True)[:max_objects]
        chosen: list[Detection] = []
        while candidates:
            best = candidates.pop(0)
            chosen.append(best)
            if max_overlap < 1:
                candidates = [d for d in candidates if box_iou(best.box, d.box) < max_overlap]
        kept[label] = chosen
    return kept


def relative_position(a: Sequence[float], b: Sequence[float], margin: float = 0.1) -> set[str]:
    """Where box ``a`` lies relative to box ``b`` (``relative_position`` in GenEval's evaluate_images.py).

    The offset between the box centres loses, per axis, ``margin`` times the sum of the two boxes' extents on that
    axis (floored at 0, sign kept); a relation holds when that reduced offset, divided by the length of the full
    offset, is beyond 0.5 on its axis: "left of" / "right of" on x, "above" / "below" on y (image y grows down).
    Boxes whose reduced offsets are both (nearly) zero have no relation: GenEval rejects such ambiguous layouts.
    """
    boxes = np.asarray([a[:4], b[:4]], dtype=np.float64).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=1)
    extent_a, extent_b = np.abs(boxes[:, 1] - boxes[:, 0])
    offset = centre_a - centre_b
    reduced = np.maximum(np.abs(offset) - margin * (extent_a + extent_b), 0) * np.sign(offset)
    if np.all(np.abs(reduced) < 1e-3):
        return set()
    dx, dy = reduced / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _position_failure(
    objects: Sequence[Detection], targets: Sequence[Detection], relation: str, margin: float
) -> set[str] | None:
    """The relations found for the first (object, target) pair lacking ``relation``; None when every pair has it."""
    for obj in objects:
        for target in targets:
            found = relative_position(obj.box, target.box, margin)
            if relation not in found:
                return found
    return None


def _position_problem(
    name: str, found: Sequence[Detection], targets: Sequence[Detection] | None, relation: str, margin: float
) -> str | None:
    """Why ``found`` (of class ``name``) is not ``relation`` of its target clause's objects (None when it is): the
    target clause failed, or a pair lacks the relation (GenEval's ``evaluate``, the server's ``evaluate_reward``)."""
    if targets is None:
        return f"no target for {name} to be {relation}"
    wrong = _position_failure(found, targets, relation, margin)
    if wrong is None:
        return None
    return f"expected {name} {relation} target, found {' and '.join(sorted(wrong))} target"


def _colour_summary(colours: list[str]) -> str:
    return ", ".join(f"{colours.count(c)} {c}" for c in COLORS if c in colours)


def check(
    metadata: Mapping[str, Any],
    objects: Mapping[str, Sequence[Detection]],
    colour_of: ColourOf,
    position_threshold: float = 0.1,
) -> tuple[bool, str]:
    """GenEval's verdict on the kept detections (``evaluate`` in GenEval's evaluate_images.py): ``(correct, reason)``.

    ``include`` clauses must all hold, in order: at least ``count`` objects of the class; the ``count`` most
    confident of them all of ``color`` (``colour_of``); each of them in ``relation`` to each of the objects the
    clause at ``index`` matched (a clause that failed leaves no target, and a position against it fails). Any
    ``exclude`` clause with ``count`` or more objects of its class makes the image wrong.
    """
    correct, reasons, matched_groups = True, [], []
    for clause in metadata.get("include") or []:
        name, count = clause["class"], clause["count"]
        found = list(objects.get(name, []))[:count]
        matched = True
        if len(found) < count:
            matched = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            colour = clause.get("color")
            if colour is not None:
                colours = colour_of(found, name)
                if colours.count(colour) < count:
                    matched = False
                    reasons.append(
                        f"expected {colour} {name}>={count}, found {colours.count(colour)} {colour}; "
                        f"and {_colour_summary(colours)}"
                    )
            position = clause.get("position")
            if position is not None and matched:
                problem = _position_problem(name, found, matched_groups[position[1]], position[0], position_threshold)
                if problem is not None:
                    matched = False
                    reasons.append(problem)
        correct = correct and matched
        matched_groups.append(found if matched else None)
    for clause in metadata.get("exclude") or []:
        present = len(objects.get(clause["class"], []))
        if present >= clause["count"]:
            correct = False
            reasons.append(f"expected {clause['class']}<{clause['count']}, found {present}")
    return correct, "\n".join(reasons)


def check_partial(
    metadata: Mapping[str, Any],
    objects: Mapping[str, Sequence[Detection]],
    colour_of: ColourOf,
    position_threshold: float = 0.1,
) -> tuple[bool, float, str]:
    """Flow-GRPO's verdict (``evaluate_reward`` in yifan123/reward-server's ``reward_server/gen_eval.py``):
    ``(strict_correct, partial, reason)``.

    Per ``include`` clause, with every kept object of its class: a count term ``1 - |count - found| / count``;
    when the count is not exact the clause fails and a colour or position it asks for adds a 0; else a colour term
    ``1 - |count - of_colour| / count`` (failing unless all are of that colour), then, when still matched, a
    position check against the clause at ``index`` (no target: a 0; a wrong pair: a 0, and in any case a 1 after
    it, as the server does). ``partial`` is the mean of the terms (0 with none); ``exclude`` is not read.
    """
    correct, reasons, terms, matched_groups = True, [], [], []
    for clause in metadata.get("include") or []:
        name, count = clause["class"], clause["count"]
        colour, position = clause.get("color"), clause.get("position")
        found = list(objects.get(name, []))
        terms.append(1 - abs(count - len(found)) / count)
        matched = True
        if len(found) != count:
            matched = False
            reasons.append(f"expected {name}=={count}, found {len(found)}")
            if colour is not None or position is not None:
                terms.append(0.0)
        else:
            if colour is not None:
                colours = colour_of(found, name)
                terms.append(1 - abs(count - colours.count(colour)) / count)
                if colours.count(colour) != count:
                    matched = False
                    reasons.append(
                        f"expected {colour} {name}=={count}, found {colours.count(colour)} {colour}; "
                        f"and {_colour_summary(colours)}"
                    )
            if position is not None and matched:
                targets = matched_groups[position[1]]
                problem = _position_problem(name, found, targets, position[0], position_threshold)
                if problem is not None:
                    matched = False
                    reasons.append(problem)
                    terms.append(0.0)
                if targets is not None:
                    terms.append(1.0)  # the server's quirk: added after the loop, failed or not
        correct = correct and matched
        matched_groups.append(found if matched else None)
    return correct, (sum(terms) / len(terms) if terms else 0.0), "\n".join(reasons)


def judge(
    metadata: Mapping[str, Any],
    detections: Sequence[Detection],
    colour_of: ColourOf,
    *,
    threshold: float = 0.3,
    counting_threshold: float = 0.9,
    max_objects: int = 16,
    max_overlap: float = 1.0,
    position_threshold: float = 0.1,
) -> Verdict:
    """One image's :class:`Verdict` from all its detections: filtered by :func:`keep_detections` at the tag's
    :func:`confidence_threshold`, then :func:`check` and :func:`check_partial`; each object's colour is asked of
    ``colour_of`` at most once, and only when a clause needs it (GenEval classifies colours lazily too)."""
    objects = keep_detections(
        detections, confidence_threshold(metadata.get("tag"), threshold, counting_threshold), max_objects, max_overlap
    )
    known: dict[Detection, str] = {}

    def cached(found: Sequence[Detection], name: str) -> list[str]:
        missing = [d for d in found if d not in known]
        if missing:
            colours = colour_of(missing, name)
            if len(colours) != len(missing):
                raise ValueError(f"the colour classifier named {len(colours)} colours for {len(missing)} objects")
            known.update(zip(missing, colours))
        return [known[d] for d in found]

    correct, reason = check(metadata, objects, cached, position_threshold)
    strict, partial_score, strict_reason = check_partial(metadata, objects, cached, position_threshold)
    return Verdict(correct, strict, partial_score, reason, strict_reason)


# -- the metadata, from a prompt's record ---------------------------------------------------------------------------

METADATA_HELP = (
    "give the prompts as records of a GenEval metadata file: data.prompts_file (or eval.prompts_file) "
    "= GenEval's prompts/evaluation_metadata.jsonl, or data.dataset = a folder of Flow-GRPO's "
    "train_metadata.jsonl / test_metadata.jsonl (splits train / test); each line "
    '{"tag": "counting", "include": [{"class": "bus", "count": 3}], "exclude": [{"class": "bus", '
    '"count": 4}], "prompt": "a photo of three buses"}'
)


def geneval_metadata(prompt: str) -> dict[str, Any]:
    """The GenEval metadata of ``prompt``: its record's ``tag``, ``include`` and ``exclude`` fields (or those of a
    ``metadata`` field holding the whole line, a mapping or its JSON), checked and normalised (absent and null
    keys dropped, so records read through Hugging Face datasets, which fill missing keys with None, work).
    Raises ValueError naming what is missing or wrong and how to give it."""
    fields: Mapping[str, Any] = prompt_fields(prompt)
    nested = fields.get("metadata")
    if "include" not in fields and isinstance(nested, (str, Mapping)):
        fields = json.loads(nested) if isinstance(nested, str) else nested
    missing = [key for key in ("tag", "include") if fields.get(key) is None]
    if missing:
        have = ", ".join(map(repr, prompt_fields(prompt))) or "none"
        raise ValueError(
            f"the geneval reward needs each prompt's GenEval metadata, and prompt {str(prompt)!r} has no "
            f"{' or '.join(map(repr, missing))} field (its fields: {have}): {METADATA_HELP}"
        )
    where = f"prompt {str(prompt)!r}'s GenEval metadata"
    include = [_clause(c, where, f"include[{i}]", i) for i, c in enumerate(fields["include"])]
    exclude = [_clause(c, where, f"exclude[{i}]", None) for i, c in enumerate(fields.get("exclude") or [])]
    return {"tag": str(fields["tag"]), "include": include, "exclude": exclude}


def _clause(clause: Any, where: str, key: str, index: int | None) -> dict[str, Any]:
    """One checked ``include`` (``index``: its place) or ``exclude`` (None) clause."""
    if not isinstance(clause, Mapping) or "class" not in clause or "count" not in clause:
        raise ValueError(f'{where}: {key} is {clause!r}; write {{"class": <a COCO class>, "count": <n>}}')
    name, count = clause["class"], clause["count"]
    if name not in CLASSES:
        raise ValueError(
            f"{where}: {key} class {name!r} is not one of GenEval's 80 COCO classes "
            f"({', '.join(CLASSES[:5])}, ...; evaluation/object_names.txt)"
        )
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"{where}: {key} count {count!r} is not a whole number >= 1")
    checked: dict[str, Any] = {"class": name, "count": count}
    colour, position = clause.get("color"), clause.get("position")
    if index is not None and colour is not None:
        if colour not in COLORS:
            raise ValueError(f"{where}: {key} color {colour!r} is not one of GenEval's colours ({', '.join(COLORS)})")
        checked["color"] = colour
    if index is not None and position is not None:
        if (
            not isinstance(position, Sequence)
            or isinstance(position, str)
            or len(position) != 2
            or position[0] not in RELATIONS
            or not isinstance(position[1], int)
            or not 0 <= position[1] < index
        ):
            raise ValueError(
                f"{where}: {key} position {position!r} is not [relation, index] with a relation of "
                f"{', '.join(RELATIONS)} and the index of an earlier include clause"
            )
        checked["position"] = (position[0], position[1])
    return checked


# -- the models ------------------------------------------------------------------------------------------------------


def _squash(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower())


_BY_SQUASHED = {**{_squash(c): c for c in CLASSES}, **{_squash(a): c for a, c in LABEL_ALIASES.items()}}


def geneval_class(label: str) -> str | None:
    """GenEval's name for a detector's class label (``"mouse"`` -> ``"computer mouse"``, ``"motorbike"`` ->
    ``"motorcycle"``, case, spaces, ``-`` and ``_`` ignored); None for a class GenEval does not know."""
    return _BY_SQUASHED.get(_squash(label))


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """Tight xyxy boxes ``[N, 4]`` of boolean masks ``[N, H, W]``: ``(x_min, y_min, x_max + 1, y_max + 1)``, zeros
    for an empty mask (mmdetection's ``mask2bbox``, which gives GenEval its boxes)."""
    boxes = torch.zeros(masks.shape[0], 4, dtype=torch.float32, device=masks.device)
    columns, rows = masks.any(dim=1), masks.any(dim=2)
    present = columns.any(dim=1)
    if present.any():
        width, height = masks.shape[2], masks.shape[1]
        x = torch.arange(width, device=masks.device)
        y = torch.arange(height, device=masks.device)
        boxes[:, 0] = torch.where(columns, x, width).amin(dim=1).float()
        boxes[:, 2] = torch.where(columns, x, -1).amax(dim=1).float() + 1
        boxes[:, 1] = torch.where(rows, y, height).amin(dim=1).float()
        boxes[:, 3] = torch.where(rows, y, -1).amax(dim=1).float() + 1
        boxes[~present] = 0
    return boxes


class Detector:
    """Mask2Former instance segmentation (transformers) as GenEval's detections, for ``[B, H, W, 3]`` uint8 images.

    Preprocessed as mmdetection's test pipeline for GenEval's model (resized, aspect kept, so the shortest edge is
    ``short_edge`` and the longest at most ``long_edge``, bilinearly; normalised with the processor's mean and std;
    padded right and bottom to a multiple of 32) and post-processed as mmdetection 2.x's ``MaskFormerFusionHead``
    (``simple_test`` and ``instance_postprocess``): mask logits upsampled to the padded input, cropped to the image,
    resized to the original size; the ``max_per_image`` best (query, class) pairs by class probability; masks at
    logit > 0; score = class probability x mean mask probability inside the mask; boxes from the masks. Only
    detections scoring above ``min_score`` are returned (their class probability must exceed it too, so the masks
    of the others are never computed). Labels are GenEval's class names; classes it does not know are dropped.
    """

    def __init__(
        self,
        source: str,
        device: torch.device | str = "cpu",
        short_edge: int = 800,
        long_edge: int = 1333,
        max_per_image: int = 100,
        min_score: float = 0.0,
    ) -> None:
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        self.device = torch.device(device)
        self.model = Mask2FormerForUniversalSegmentation.from_pretrained(source).to(self.device).eval()
        self.model.requires_grad_(False)
        processor = AutoImageProcessor.from_pretrained(source)
        self.mean = torch.tensor(processor.image_mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(processor.image_std, device=self.device).view(1, 3, 1, 1)
        names = {int(i): geneval_class(label) for i, label in self.model.config.id2label.items()}
        absent = sorted(set(CLASSES) - set(names.values()), key=CLASSES.index)
        if absent:
            raise ValueError(
                f"detector {source!r} does not detect {len(absent)} of GenEval's classes "
                f"({', '.join(absent[:8])}{', ...' if len(absent) > 8 else ''}): give a COCO instance "
                "segmentation model, e.g. facebook/mask2former-swin-small-coco-instance"
            )
        self.names = [names.get(i) for i in range(self.model.config.num_labels)]
        self.known = torch.tensor([n is not None for n in self.names], device=self.device)
        self.short_edge, self.long_edge = short_edge, long_edge
        self.max_per_image, self.min_score = max_per_image, min_score

    def input_size(self, height: int, width: int) -> tuple[int, int]:
        """The resized image's size: mmcv's ``rescale_size`` for the scale (long_edge, short_edge)."""
        scale = min(self.short_edge / min(height, width), self.long_edge / max(height, width))
        return int(height * scale + 0.5), int(width * scale + 0.5)

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> list[list[Detection]]:
        """Each image's detections (``images``: ``[B, H, W, 3]`` uint8, one size)."""
        if len(images) == 0:
            return []
        pixels = torch.as_tensor(np.ascontiguousarray(images), device=self.device).permute(0, 3, 1, 2).float() / 255
        height, width = pixels.shape[-2:]
        size = self.input_size(height, width)
        resized = torch.nn.functional.interpolate(pixels, size=size, mode="bilinear", align_corners=False)
        padded = (-(-size[0] // 32) * 32, -(-size[1] // 32) * 32)
        inputs = torch.nn.functional.pad(
            (resized - self.mean) / self.std, (0, padded[1] - size[1], 0, padded[0] - size[0])
        )
        outputs = self.model(pixel_values=inputs)
        return [
            self._instances(classes, masks, size, padded, (height, width))
            for classes, masks in zip(outputs.class_queries_logits, outputs.masks_queries_logits)
        ]

    def _instances(
        self,
        class_logits: torch.Tensor,
        mask_logits: torch.Tensor,
        size: tuple[int, int],
        padded: tuple[int, int],
        original: tuple[int, int],
    ) -> list[Detection]:
        """One image's detections from its ``[Q, C + 1]`` class logits and ``[Q, h, w]`` mask logits."""
        probs = class_logits.float().softmax(-1)[:, :-1]
        num_classes = probs.shape[1]
        scores, flat = probs.flatten().topk(min(self.max_per_image, probs.numel()))
        labels, queries = flat % num_classes, flat // num_classes
        keep = (scores > self.min_score) & self.known[labels]
        if not keep.any():
            return []
        scores, labels, queries = scores[keep], labels[keep], queries[keep]
        logits = torch.nn.functional.interpolate(
            mask_logits[queries][None].float(), size=padded, mode="bilinear", align_corners=False
        )[..., : size[0], : size[1]]
        logits = torch.nn.functional.interpolate(logits, size=original, mode="bilinear", align_corners=False)[0]
        masks = logits > 0
        mask_scores = (logits.sigmoid() * masks).flatten(1).sum(1) / (masks.flatten(1).sum(1) + 1e-6)
        scores = scores * mask_scores
        boxes = mask_boxes(masks)
        chosen = scores > self.min_score
        scores, labels = scores[chosen].tolist(), labels[chosen].tolist()
        boxes, masks = boxes[chosen].tolist(), masks[chosen].cpu().numpy()
        return [
            Detection(self.names[label], tuple(box), score, mask)
            for label, box, score, mask in zip(labels, boxes, scores, masks)
        ]


class ClipColours:
    """GenEval's colour classifier (``color_classification``): open_clip zero-shot over :data:`COLORS`.

    Each object is cut out as GenEval does (pixels outside its mask painted :data:`BACKGROUND`, then cropped to
    its box), put through the model's own preprocessing, and matched against one text embedding per colour: the
    mean of the unit embeddings of :data:`COLOUR_TEMPLATES` for that colour and class, renormalised
    (clip_benchmark's ``zero_shot_classifier``, which GenEval uses, with ViT-L-14 ``openai``).
    """

    def __init__(
        self,
        model: str = "ViT-L-14",
        pretrained: str | None = "openai",
        device: torch.device | str = "cpu",
        batch_size: int = 16,
    ) -> None:
        import open_clip

        name = model
        if name.endswith(".json"):
            open_clip.add_model_config(Path(name))
            name = Path(name).stem
        self.device = torch.device(device)
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(
            name, pretrained=pretrained or None, device=self.device
        )
        self.model.eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(name)
        self.batch_size = batch_size
        self._heads: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def head(self, classname: str) -> torch.Tensor:
        """``[D, len(COLORS)]`` unit colour embeddings for objects of ``classname`` (computed once per class)."""
        if classname not in self._heads:
            columns = []
            for colour in COLORS:
                texts = [t.format(color=colour, object=classname) for t in COLOUR_TEMPLATES]
                embedded = self.model.encode_text(self.tokenizer(texts).to(self.device)).float()
                mean = torch.nn.functional.normalize(embedded, dim=-1).mean(dim=0)
                columns.append(mean / mean.norm())
            self._heads[classname] = torch.stack(columns, dim=1)
        return self._heads[classname]

    @staticmethod
    def crops(image: np.ndarray, detections: Sequence[Detection]) -> list:
        """Each object as GenEval shows it to CLIP: masked onto :data:`BACKGROUND`, cropped to its box (PIL images)."""
        from PIL import Image

        picture = Image.fromarray(np.ascontiguousarray(image)).convert("RGB")
        blank = Image.new("RGB", picture.size, color=BACKGROUND)
        out = []
        for detection in detections:
            shown = picture
            if detection.mask is not None:
                shown = Image.composite(picture, blank, Image.fromarray(np.asarray(detection.mask, dtype=bool)))
            out.append(shown.crop(tuple(detection.box[:4])))
        return out

    @torch.no_grad()
    def __call__(self, image: np.ndarray, detections: Sequence[Detection], classname: str) -> list[str]:
        """The colour of each of ``detections`` (all of class ``classname``) in ``image`` (``[H, W, 3]`` uint8)."""
        head, names = self.head(classname), []
        crops = self.crops(image, detections)
        for begin in range(0, len(crops), self.batch_size):
            batch = torch.stack([self.preprocess(c) for c in crops[begin : begin + self.batch_size]]).to(self.device)
            features = torch.nn.functional.normalize(self.model.encode_image(batch).float(), dim=-1)
            names += [COLORS[i] for i in (100.0 * features @ head).argmax(dim=1).tolist()]
        return names


# -- the reward ------------------------------------------------------------------------------------------------------


@dataclass
class GenEvalOptions:
    detector: str = option(
        "facebook/mask2former-swin-small-coco-instance",
        check=pretrained_source,
        help="a Mask2FormerForUniversalSegmentation COCO instance model (folder or hub id)",
    )
    short_edge: int = option(
        800,
        ge=32,
        help="the detector sees images resized to this shortest edge (mmdetection's "
        "test scale for GenEval's Mask2Former: 800)",
    )
    long_edge: int = option(1333, ge=32, help="... and at most this longest edge (mmdetection: 1333)")
    clip_model: str = option(
        "ViT-L-14",
        help="the open_clip model naming colours (GenEval: ViT-L-14), or the path of a model-config json",
        check=lambda v: (
            "no such model-config file" if v.endswith(".json") and not Path(v).expanduser().is_file() else None
        ),
    )
    clip_pretrained: str = option(
        "openai",
        help="its pretrained tag (GenEval: openai; downloaded once by open_clip) or the path of a checkpoint file",
    )
    threshold: float = option(0.3, ge=0, lt=1, help="detections count above this confidence (GenEval: 0.3)")
    counting_threshold: float = option(
        0.9, ge=0, lt=1, help="... and above this one for counting prompts (GenEval: 0.9)"
    )
    max_objects: int = option(16, ge=1, help="at most this many detections per class, the most confident (GenEval: 16)")
    max_overlap: float = option(
        1.0,
        gt=0,
        le=1,
        help="non-maximum suppression: a box overlapping a more confident "
        "one of its class by this IoU or more is dropped (GenEval: 1, "
        "none)",
    )
    position_threshold: float = option(
        0.1, ge=0, help="the margin, in box extents, a relative position must clear (GenEval: 0.1)"
    )
    score: Literal["partial", "correct", "strict"] = option(
        "partial",
        help="what the reward's score is: partial (Flow-GRPO's training reward), correct (GenEval's "
        "verdict), strict (Flow-GRPO's exact-count verdict); all three are logged",
    )
    batch_size: int = option(16, ge=1, help="images per detector forward pass")


#: The component each ``score`` option makes the score.
SCORES = {"partial": "partial", "correct": "correct", "strict": "strict_correct"}

#: The image-level colour classifier the reward uses: ``(image [H, W, 3] uint8, detections, classname) -> colours``.
ColourClassifier = Callable[[np.ndarray, Sequence[Detection], str], list[str]]


class GenEval:
    """Scores each image against its prompt record's GenEval metadata (see the module's docstring).

    ``detector`` (``[B, H, W, 3]`` uint8 images -> each image's :class:`Detection` list) and ``colours``
    (:data:`ColourClassifier`) replace the models the options name, for tests and custom models.
    """

    kinds: ClassVar[set[str]] = {"image"}

    def __init__(
        self,
        options: GenEvalOptions,
        context: BuildContext | None = None,
        *,
        detector: Callable[[np.ndarray], list[list[Detection]]] | None = None,
        colours: ColourClassifier | None = None,
    ) -> None:
        device = reward_device(context)
        self.detector = detector or Detector(
            options.detector,
            device,
            options.short_edge,
            options.long_edge,
            min_score=min(options.threshold, options.counting_threshold),
        )
        self.colours = colours or ClipColours(options.clip_model, options.clip_pretrained, device)
        self.options = options
        self.batch_size = options.batch_size

    def verdicts(self, images: np.ndarray, metadata: Sequence[Mapping[str, Any]]) -> list[Verdict]:
        """Each image's :class:`Verdict` (``images``: ``[B, H, W, 3]`` uint8; ``metadata``: each one's, as
        :func:`geneval_metadata` gives it)."""
        found, o = self.detector(images), self.options
        return [
            judge(
                m,
                d,
                partial(self.colours, image),
                threshold=o.threshold,
                counting_threshold=o.counting_threshold,
                max_objects=o.max_objects,
                max_overlap=o.max_overlap,
                position_threshold=o.position_threshold,
            )
            for m, d, image in zip(metadata, found, images)
        ]

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        metadata = [geneval_metadata(p) for p in prompts]  # every prompt checked before any model runs
        images = eight_bit(media.data)
        verdicts = self.verdicts(images.permute(0, 2, 3, 1).numpy(), metadata)
        out = {
            "partial": torch.tensor([v.partial for v in verdicts], dtype=torch.float32),
            "correct": torch.tensor([float(v.correct) for v in verdicts]),
            "strict_correct": torch.tensor([float(v.strict_correct) for v in verdicts]),
        }
        out["score"] = out[SCORES[self.options.score]].clone()
        for tag in TAGS:
            out[f"correct_{tag}"] = torch.tensor(
                [float(v.correct) if m["tag"] == tag else float("nan") for v, m in zip(verdicts, metadata)]
            )
        return out
