"""OCR reward with real engines on words rendered by PIL: PP-OCR (the default, installed by pip with its
models) and Tesseract (when its program is installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from gyremedia.rollout import Media
from gyremedia_rewards.ocr import OcrOptions, OcrReward, edit_distance, quoted_text, text_similarity


def rendered(*words: str) -> Media:
    font = ImageFont.load_default(size=28)
    pictures = []
    for word in words:
        picture = Image.new("RGB", (256, 48), "white")
        ImageDraw.Draw(picture).text((8, 6), word, fill="black", font=font)
        pictures.append(torch.from_numpy(np.array(picture)).permute(2, 0, 1).float() / 255)
    return Media("image", torch.stack(pictures))


def test_text_helpers():
    assert quoted_text('a neon sign that says "OPEN late" on a wall') == "OPEN late"
    assert quoted_text("a mug reading “coffee” and 'tea'") == "coffee tea"
    with pytest.raises(ValueError, match="quotes no text"):
        quoted_text("a sign")
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert text_similarity("Hello", "hello") == 1.0 and text_similarity("Hello", "hello", case_sensitive=True) == 0.8
    assert text_similarity("abc", "completely different") == 0.0


def tesseract_installed() -> bool:
    import shutil

    return shutil.which("tesseract") is not None


@pytest.fixture(scope="module", params=["rapidocr", "tesseract"])
def ocr(request) -> OcrReward:
    if request.param == "tesseract" and not tesseract_installed():
        pytest.skip("the tesseract program is not installed (apt-get install tesseract-ocr); rapidocr is the default")
    return OcrReward(OcrOptions(engine=request.param))


def test_the_default_engine_needs_nothing_but_pip():
    assert OcrOptions().engine == "rapidocr"
    reward = OcrReward(OcrOptions(detect=False))  # the whole image read as one line
    assert reward(rendered("sunset"), ['a card with "sunset"'])["exact"].item() == 1.0


@pytest.mark.skipif(tesseract_installed(), reason="checks the message for a machine without tesseract")
def test_a_missing_tesseract_says_how_to_install_it_or_which_engine_to_use():
    with pytest.raises(RuntimeError, match="apt-get install tesseract-ocr \\(or use engine: rapidocr\\)"):
        OcrReward(OcrOptions(engine="tesseract"))


def test_reads_the_right_word_and_scores_a_wrong_one_lower(ocr):
    media = rendered("gyremedia", "gyremedia", "flow matching", "sunset")
    prompts = [
        'a sign that says "gyremedia"',
        'a sign that says "diffusion"',
        'a poster reading "flow matching"',
        'a card with "sunrise"',
    ]
    scores = ocr(media, prompts)
    assert scores["score"][0] == 1.0 and scores["exact"][0] == 1.0
    assert scores["score"][2] == 1.0
    assert scores["score"][1] < 0.5  # "gyremedia" read where "diffusion" was asked
    assert 0.5 < scores["score"][3] < 1.0  # "sunset" vs "sunrise": close but not exact
    assert scores["exact"][3] == 0.0


def test_a_blank_image_scores_low(ocr):
    # an engine may hallucinate a glyph or two on a blank page, never the asked word
    assert ocr(Media("image", torch.ones(1, 3, 48, 256)), ['"hello"'])["score"].item() < 0.5


def test_the_target_comes_from_the_records_field_else_from_the_quotes():
    from gyremedia.data import Prompt
    from gyremedia_rewards.ocr import target_text

    assert target_text('a sign that says "OPEN"', "target_text") == "OPEN"
    assert target_text(Prompt("a shop sign", {"target_text": "CLOSED"}), "target_text") == "CLOSED"
