"""The ShapesBench verifier: reads objects back from pixels and checks each criterion of a prompt.

No learned weights: pixels are classified by colour, grouped into 4-connected components, and each
component's shape is told from how much of its bounding box it fills (a square fills it) and from
whether its pixels sit mostly in its lower half (a triangle, apex up) or evenly (a circle).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, as arrays of (row, col)."""
    seen = np.zeros_like(mask)
    height, width = mask.shape
    found = []
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        stack, pixels = [start], []
        seen[start] = True
        while stack:
            r, c = stack.pop()
            pixels.append((r, c))
            for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= nr < height and 0 <= nc < width and mask[nr, nc] and not seen[nr, nc]:
                    seen[nr, nc] = True
                    stack.append((nr, nc))
        found.append(np.array(pixels))
    return found


def detect(image: np.ndarray) -> list[DetectedObject]:
    """Objects in a ``[H, W, 3]`` image with values in [0, 1]."""
    on = image.max(axis=-1) > ON_THRESHOLD
    colour_index = image.argmax(axis=-1)
    objects = []
    for index, colour in enumerate(_COLOUR_NAMES):
        for pixels in _components(on & (colour_index == index)):
            if len(pixels) < MIN_PIXELS:
                continue
            objects.append(DetectedObject(colour, _shape_of(pixels), float(pixels[:, 1].mean()),
                                          float(pixels[:, 0].mean()), len(pixels)))
    return objects


def _shape_of(pixels: np.ndarray) -> str:
    rows, cols = pixels[:, 0], pixels[:, 1]
    if len(pixels) / ((rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)) >= SQUARE_FILL:
        return "square"
    middle = (rows.min() + rows.max()) / 2
    top, bottom = (rows < middle).sum(), (rows > middle).sum()
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
    if isinstance(prompt, str):
        prompt = parse_prompt(prompt)
    objects = detect(image)
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
