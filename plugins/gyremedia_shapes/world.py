"""ShapesBench: a GenEval-like compositional world small enough to learn on a CPU.

Prompts name coloured shapes with a count ("two red circles") or two shapes in a spatial
relation ("a red circle left of a blue square"). The canvas is a 2x2 grid of cells; each object
fills most of one cell, so objects never touch and a deterministic verifier can read them back.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass

import numpy as np

from gyremedia.data import prompt_fields

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
}
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
RELATIONS = ("left of", "right of", "above", "below")
CANVAS = 16  # pixels; a 2x2 grid of 8-pixel cells
CELL = CANVAS // 2
OBJECT_SIZES = (6, 7)  # an object of size s sits at offset 0..7-s in its cell: always a 1-pixel gap

#: Every word a prompt can contain (the tokenizer gives each one a single token).
VOCABULARY = sorted(
    {"a", "of", "left", "right", "above", "below", *COUNT_WORDS.values(), *COLOURS, *SHAPES, *(s + "s" for s in SHAPES)}
)


@dataclass(frozen=True)
class Prompt:
    """A parsed prompt: ``count`` objects of one kind, or two objects in a ``relation``."""

    colour: str
    shape: str
    count: int = 1
    relation: str | None = None
    colour2: str | None = None
    shape2: str | None = None

    @property
    def text(self) -> str:
        if self.relation is None:
            noun = self.shape + ("s" if self.count > 1 else "")
            return f"{COUNT_WORDS[self.count]} {self.colour} {noun}"
        return f"a {self.colour} {self.shape} {self.relation} a {self.colour2} {self.shape2}"

    @property
    def criteria(self) -> tuple[str, ...]:
        """What the verifier checks for this prompt."""
        return ("object", "colour", "count", "position") if self.relation else ("object", "colour", "count")


_SINGLE = re.compile(rf"^(a|two|three) ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})s?$")
_RELATION = re.compile(
    rf"^a ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)}) ({'|'.join(RELATIONS)}) a ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})$"
)


def parse_prompt(text: str) -> Prompt:
    """Parse a ShapesBench prompt; raises ``ValueError`` naming the grammar for anything else."""
    text = " ".join(text.lower().split())
    if m := _SINGLE.match(text):
        count = {v: k for k, v in COUNT_WORDS.items()}[m.group(1)]
        return Prompt(colour=m.group(2), shape=m.group(3), count=count)
    if m := _RELATION.match(text):
        if m.group(1) == m.group(4):
            raise ValueError(f"{text!r}: the two objects of a relation must have different colours")
        return Prompt(colour=m.group(1), shape=m.group(2), relation=m.group(3), colour2=m.group(4), shape2=m.group(5))
    raise ValueError(
        f"{text!r} is not a ShapesBench prompt: expected 'a|two|three COLOUR SHAPE[s]' or "
        f"'a COLOUR SHAPE (left of|right of|above|below) a COLOUR SHAPE' with colours "
        f"{', '.join(COLOURS)} and shapes {', '.join(SHAPES)}"
    )


def record(text: str) -> dict[str, object]:
    """A prompt as a record (a jsonl line of the prompt sets): its text and its fields, GenEval-style metadata
    the verifier reads instead of parsing the text."""
    fields = {k: v for k, v in dataclasses.asdict(parse_prompt(text)).items() if v is not None}
    return {"prompt": text, **fields}


def record_prompt(prompt: str) -> Prompt:
    """The world's prompt for a record: built from its fields when it has them, else parsed from its text."""
    fields = prompt_fields(prompt)
    if "shape" not in fields:
        return parse_prompt(prompt)
    return Prompt(**{f.name: fields[f.name] for f in dataclasses.fields(Prompt) if f.name in fields})


def all_prompts() -> list[Prompt]:
    singles = [Prompt(c, s, n) for n in COUNT_WORDS for c in COLOURS for s in SHAPES]
    relations = [
        Prompt(c1, s1, relation=r, colour2=c2, shape2=s2)
        for r in RELATIONS
        for c1, s1, c2, s2 in itertools.product(COLOURS, SHAPES, COLOURS, SHAPES)
        if c1 != c2
    ]
    return singles + relations


def split_prompts(
    seed: int = 0, heldout_singles: int = 3, heldout_relation_fraction: float = 0.2
) -> tuple[list[str], list[str]]:
    """Train and held-out prompts. Held-out ones are unseen combinations of seen words:
    multi-object counts of (colour, shape) pairs and a share of the relation triples."""
    rng = np.random.default_rng(seed)
    prompts = all_prompts()
    multi = [p for p in prompts if p.relation is None and p.count > 1]
    relations = [p for p in prompts if p.relation is not None]
    held = {multi[i] for i in rng.choice(len(multi), heldout_singles, replace=False)}
    held |= {
        relations[i]
        for i in rng.choice(len(relations), round(len(relations) * heldout_relation_fraction), replace=False)
    }
    train = [p.text for p in prompts if p not in held]
    heldout = [p.text for p in prompts if p in held]
    return train, heldout


# --------------------------------------------------------------------------- rendering


def _mask(shape: str, size: int) -> np.ndarray:
    centres = np.arange(size) + 0.5
    y, x = np.meshgrid(centres, centres, indexing="ij")
    if shape == "square":
        return np.ones((size, size), dtype=bool)
    if shape == "circle":
        return (x - size / 2) ** 2 + (y - size / 2) ** 2 <= (size / 2 - 0.1) ** 2  # clearly rounder than a square
    if shape == "triangle":  # apex up, base on the bottom row
        return np.abs(x - size / 2) <= y / 2
    raise ValueError(f"unknown shape {shape!r}")


def cells_for(prompt: Prompt, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Grid cells (row, col) for each object, in the order the prompt names them."""
    cells = [(r, c) for r in range(2) for c in range(2)]
    if prompt.relation is None:
        return [cells[i] for i in rng.choice(4, prompt.count, replace=False)]
    first, second = (int(v) for v in rng.integers(0, 2, size=2))
    if prompt.relation in ("left of", "right of"):
        a, b = (first, 0), (second, 1)
    else:
        a, b = (0, first), (1, second)
    return [a, b] if prompt.relation in ("left of", "above") else [b, a]


def render(prompt: Prompt | str, rng: np.random.Generator, cells: list[tuple[int, int]] | None = None) -> np.ndarray:
    """A ``[CANVAS, CANVAS, 3]`` float image in [0, 1] that satisfies ``prompt``, its objects in ``cells`` (grid
    (row, col) per object in the prompt's order; drawn at random when None)."""
    if isinstance(prompt, str):
        prompt = parse_prompt(prompt)
    image = np.zeros((CANVAS, CANVAS, 3), dtype=np.float32)
    if prompt.relation is None:
        objects = [(prompt.colour, prompt.shape)] * prompt.count
    else:
        objects = [(prompt.colour, prompt.shape), (prompt.colour2, prompt.shape2)]
    for (colour, shape), (row, col) in zip(objects, cells or cells_for(prompt, rng), strict=True):
        size = int(rng.choice(OBJECT_SIZES))
        dy, dx = (int(v) for v in rng.integers(0, CELL - size, size=2))  # offsets 0 .. 7 - size
        top, left = row * CELL + dy, col * CELL + dx
        image[top : top + size, left : left + size][_mask(shape, size)] = COLOURS[colour]
    return image


def render_batch(prompts: list[str], rng: np.random.Generator) -> np.ndarray:
    """``[B, 3, CANVAS, CANVAS]`` images for a list of prompts."""
    return np.stack([render(p, rng) for p in prompts]).transpose(0, 3, 1, 2)
