"""The ShapesBench verifier: reads objects back from pixels and checks each criterion of a prompt.

No learned weights: pixels are classified by colour, grouped into 4-connected components, and each
component's shape is told from how much of its bounding box it fills (a square fills it) and from
whether its pixels sit mostly in its lower half (a triangle, apex up) or evenly (a circle).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from gyremedia_shapes.world import COLOURS, Prompt, parse_prompt

ON_THRESHOLD = 0.5  # a pixel belongs to an object if its strongest channel exceeds this
MIN_PIXELS = 8  # smaller components are noise (the smallest object, a 6-pixel triangle, has 18)
SQUARE_FILL = 0.87  # squares fill their box; circles fill 0.67-0.76 of it
TRIANGLE_TOP_RATIO = 0.75  # pixels above / below the box's middle row: ~0.4 for triangles, 1 for circles
POSITION_MARGIN = 2.0  # pixels between centroids for a relation to hold
CRITERIA = ("object", "colour", "count", "position")
_COLOUR_NAMES = list(COLOURS)


@dataclass(frozen=True)
class DetectedObject:
    colour: str
    shape: str
    x: float  # centroid column
    y: float  # centroid row
    pixels: int


# 4-connectivity within each image plane, none across planes: one labelling call finds every object of a batch
_IN_PLANE = np.zeros((3, 3, 3), dtype=bool)
_IN_PLANE[1] = ndimage.generate_binary_structure(2, 1)


def detect_batch(images: np.ndarray) -> list[list[DetectedObject]]:
    """The objects of each ``[H, W, 3]`` image of ``images [N, H, W, 3]`` (values in [0, 1]).

    Each (image, colour) plane's pixels of that colour are labelled into 4-connected components in one
    vectorised pass; a component's size, centroid, bounding box and half-box counts come from bincounts.
    """
    count, height, width, _ = images.shape
    on = images.max(axis=-1) > ON_THRESHOLD
    colour_index = images.argmax(axis=-1)
    colours = len(_COLOUR_NAMES)
    planes = np.stack([on & (colour_index == c) for c in range(colours)], axis=1)  # [N, C, H, W]
    labels, found = ndimage.label(planes.reshape(-1, height, width), structure=_IN_PLANE)
    objects: list[list[DetectedObject]] = [[] for _ in range(count)]
    if not found:
        return objects
    plane, rows, cols = np.nonzero(labels)
    ids = labels[plane, rows, cols]
    size = np.bincount(ids, minlength=found + 1)
    centroid_x = np.bincount(ids, weights=cols, minlength=found + 1)[1:] / size[1:]
    centroid_y = np.bincount(ids, weights=rows, minlength=found + 1)[1:] / size[1:]
    boxes = ndimage.find_objects(labels)  # per label: its (plane, row, column) slices
    rows_low = np.array([box[1].start for box in boxes])
    rows_high = np.array([box[1].stop - 1 for box in boxes])
    box_area = (rows_high - rows_low + 1) * np.array([box[2].stop - box[2].start for box in boxes])
    middle = (rows_low + rows_high) / 2
    top = np.bincount(ids, weights=rows < middle[ids - 1], minlength=found + 1)[1:]
    bottom = np.bincount(ids, weights=rows > middle[ids - 1], minlength=found + 1)[1:]
    for label, box in enumerate(boxes):
        pixels = int(size[label + 1])
        if pixels < MIN_PIXELS:
            continue
        image, colour = divmod(box[0].start, colours)
        objects[image].append(
            DetectedObject(
                _COLOUR_NAMES[colour],
                _shape_of(pixels / box_area[label], top[label], bottom[label]),
                float(centroid_x[label]),
                float(centroid_y[label]),
                pixels,
            )
        )
    return objects


def detect(image: np.ndarray) -> list[DetectedObject]:
    """Objects in a ``[H, W, 3]`` image with values in [0, 1]."""
    return detect_batch(image[None])[0]


def _shape_of(box_fill: float, top: float, bottom: float) -> str:
    """A square fills its bounding box; a triangle (apex up) has fewer pixels above the box's middle row
    than below it; a circle about as many."""
    if box_fill >= SQUARE_FILL:
        return "square"
    return "triangle" if top < TRIANGLE_TOP_RATIO * bottom else "circle"


def _holds(relation: str, a: DetectedObject, b: DetectedObject) -> bool:
    if relation == "left of":
        return a.x < b.x - POSITION_MARGIN
    if relation == "right of":
        return a.x > b.x + POSITION_MARGIN
    if relation == "above":
        return a.y < b.y - POSITION_MARGIN
    return a.y > b.y + POSITION_MARGIN  # below


def verify(image: np.ndarray, prompt: Prompt | str) -> dict[str, bool]:
    """Each applicable criterion of ``prompt`` on ``image`` and ``correct`` (all of them hold).

    object: every named shape is present (any colour); colour: every named (colour, shape) pair is
    present; count: the image holds exactly the named objects, no more, no fewer; position: the
    named relation holds between the two named objects.
    """
    return verify_batch(image[None], [prompt])[0]


def verify_batch(images: np.ndarray, prompts: list[Prompt | str]) -> list[dict[str, bool]]:
    """:func:`verify` of each image of ``images [N, H, W, 3]`` against its prompt, detected in one pass."""
    return [
        _criteria(objects, parse_prompt(prompt) if isinstance(prompt, str) else prompt)
        for objects, prompt in zip(detect_batch(images), prompts, strict=True)
    ]


def _criteria(objects: list[DetectedObject], prompt: Prompt) -> dict[str, bool]:
    if prompt.relation is None:
        wanted = [(prompt.colour, prompt.shape)] * prompt.count
    else:
        wanted = [(prompt.colour, prompt.shape), (prompt.colour2, prompt.shape2)]
    shapes = {o.shape for o in objects}
    pairs = [(o.colour, o.shape) for o in objects]
    result = {
        "object": all(shape in shapes for _, shape in wanted),
        "colour": all(pair in pairs for pair in wanted),
        "count": sorted(pairs) == sorted(wanted),
    }
    if prompt.relation is not None:
        first = [o for o in objects if (o.colour, o.shape) == wanted[0]]
        second = [o for o in objects if (o.colour, o.shape) == wanted[1]]
        result["position"] = any(_holds(prompt.relation, a, b) for a in first for b in second)
    result["correct"] = all(result.values())
    return result
