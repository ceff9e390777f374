"""OCR reward (Flow-GRPO's text rendering task): does the image show the text its prompt quotes?

``score = max(0, 1 - edit_distance(quoted, read) / len(quoted))``, where ``quoted`` is the text
between quotes in the prompt (``a sign that says "OPEN"``; a prompt record's ``target_text`` field when it has
one) and ``read`` what a real OCR engine reads
from the image, offline:

- ``rapidocr`` (default): PP-OCR's detection and recognition models on onnxruntime, shipped inside the
  ``rapidocr-onnxruntime`` wheel, so ``pip install`` is all it needs;
- ``tesseract``: the Tesseract program through pytesseract (``apt-get install tesseract-ocr``,
  ``pip install gyremedia[ocr]``).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from gyremedia.data import prompt_fields
from gyremedia.interfaces import BuildContext
from gyremedia.options import option
from gyremedia.rollout import Media

QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”|\'([^\']+)\'')


@dataclass
class OcrOptions:
    engine: Literal["rapidocr", "tesseract"] = option("rapidocr", help="the OCR engine (rapidocr needs only pip)")
    detect: bool = option(True, help="rapidocr: find text boxes first (false reads the whole image as one line)")
    tesseract_config: str = option("--psm 7", help="tesseract: page segmentation 7, the image is one line of text")
    lang: str = option("eng", help="tesseract: language")
    case_sensitive: bool = option(False, help="compare case too")
    min_height: int = option(64, ge=1, help="smaller images are upscaled first (OCR misreads tiny glyphs)")
    workers: int = option(4, ge=1, help="images read in parallel")
    target_field: str = option(
        "target_text",
        help="the prompt record's field holding the text to read; a prompt without it is read for its quoted text",
    )


def target_text(prompt: str, field: str) -> str:
    """The text an image of ``prompt`` should show: its record's ``field``, else the text its prompt quotes."""
    value = prompt_fields(prompt).get(field)
    return str(value) if value is not None else quoted_text(prompt)


def quoted_text(prompt: str) -> str:
    """The text a prompt asks to render: everything between its quotes, joined by spaces."""
    parts = [next(g for g in match.groups() if g is not None) for match in QUOTED.finditer(prompt)]
    if not parts:
        raise ValueError(f'prompt {prompt!r} quotes no text to read: write it as: a sign that says "OPEN"')
    return " ".join(parts)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions and substitutions each cost 1)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def text_similarity(target: str, read: str, case_sensitive: bool = False) -> float:
    """``1 - edit_distance / len(target)``, floored at 0; whitespace runs count as one space."""
    target, read = " ".join(target.split()), " ".join(read.split())
    if not case_sensitive:
        target, read = target.lower(), read.lower()
    return max(0.0, 1.0 - edit_distance(target, read) / max(len(target), 1))


class RapidOcrEngine:
    """PP-OCR (detection + recognition) on onnxruntime, with the models its wheel ships."""

    def __init__(self, options: OcrOptions) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:
            raise ImportError(
                "the ocr reward's rapidocr engine needs rapidocr-onnxruntime: pip install rapidocr-onnxruntime"
            ) from exc
        self.model = RapidOCR()
        self.detect = options.detect

    def read(self, picture: Image.Image) -> str:
        """The text in reading order: boxes top to bottom, then left to right."""
        pixels = np.asarray(picture.convert("RGB"))
        if not self.detect:
            result, _ = self.model(pixels, use_det=False, use_cls=False, use_rec=True)
            return " ".join(text for text, _ in result or []).strip()
        result, _ = self.model(pixels)
        boxes = sorted(result or [], key=lambda r: (round(min(p[1] for p in r[0]) / 8), min(p[0] for p in r[0])))
        return " ".join(text.strip() for _, text, _ in boxes)


class TesseractEngine:
    """The Tesseract program through pytesseract."""

    def __init__(self, options: OcrOptions) -> None:
        try:
            import pytesseract
        except ImportError as exc:
            raise ImportError(
                "the ocr reward's tesseract engine needs pytesseract: pip install 'gyremedia[ocr]'"
            ) from exc
        try:
            pytesseract.get_tesseract_version()
        except pytesseract.TesseractNotFoundError as exc:
            raise RuntimeError(
                "the ocr reward's tesseract engine needs the tesseract program: apt-get install "
                "tesseract-ocr (or use engine: rapidocr)"
            ) from exc
        self.tesseract = pytesseract
        self.options = options

    def read(self, picture: Image.Image) -> str:
        return self.tesseract.image_to_string(
            picture, lang=self.options.lang, config=self.options.tesseract_config
        ).strip()


ENGINES = {"rapidocr": RapidOcrEngine, "tesseract": TesseractEngine}


class OcrReward:
    """Scores each image by how closely the OCR engine's reading matches the prompt's quoted text."""

    kinds = {"image"}

    def __init__(self, options: OcrOptions, context: BuildContext | None = None) -> None:
        self.engine = ENGINES[options.engine](options)
        self.options = options

    def read(self, image: np.ndarray) -> str:
        """The text the engine reads in one ``[H, W, 3]`` uint8 image (upscaled to ``min_height`` first)."""
        picture = Image.fromarray(image)
        if picture.height < self.options.min_height:
            scale = self.options.min_height / picture.height
            picture = picture.resize((round(picture.width * scale), self.options.min_height), Image.BICUBIC)
        return self.engine.read(picture)

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        targets = [target_text(p, self.options.target_field) for p in prompts]
        pixels = (media.data.detach().cpu().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        with ThreadPoolExecutor(max_workers=self.options.workers) as pool:
            readings = list(pool.map(self.read, list(pixels)))
        scores = [text_similarity(t, r, self.options.case_sensitive) for t, r in zip(targets, readings)]
        return {"score": torch.tensor(scores), "exact": torch.tensor([float(s == 1.0) for s in scores])}
