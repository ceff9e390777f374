"""PickScore and the LAION aesthetic predictor on tiny random-weight CLIP replicas built offline from the same
transformers classes, against their references' formulas: PickScore's README inference example and Flow-GRPO's
``pickscore_scorer.py`` (``logit_scale.exp() * text_embs @ image_embs.T``, the diagonal, / 26), LAION's
``simple_inference.py`` and Flow-GRPO's ``aesthetic_scorer.py`` (the MLP on the unit ``get_image_features``)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from gyremedia.rollout import Media
from gyremedia_rewards.preference import (
    AestheticOptions,
    AestheticScore,
    PickScore,
    PickScoreOptions,
    aesthetic_head,
    projected,
)
from tiny_clip import save_tiny_clip

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A CLIPModel (vision and text towers of width 32, projection 24) and its CLIPProcessor, saved as a folder."""
    return save_tiny_clip(
        tmp_path_factory.mktemp("tiny_clip"), ["a", "red", "circle", "two", "blue", "squares", "green", "triangle"]
    )


def images() -> torch.Tensor:
    """Three 40 x 48 images in [0, 1] (not square: the processor resizes the shortest side, then crops)."""
    return torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(1))


def reference_inputs(folder):
    """The references' own path: CLIPModel / CLIPProcessor from the folder, PIL images of the 8-bit pixels."""
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
    pixels = (images() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return model, processor, [Image.fromarray(p) for p in pixels]


def test_pickscore_is_its_references_formula(tiny_clip):
    model, processor, pictures = reference_inputs(tiny_clip)
    with torch.no_grad():
        image_embs = projected(model.get_image_features(**processor(images=pictures, return_tensors="pt")))
        image_embs = image_embs / image_embs.norm(dim=-1, keepdim=True)
        text_embs = projected(
            model.get_text_features(
                **processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
            )
        )
        text_embs = text_embs / text_embs.norm(dim=-1, keepdim=True)
        expected = (model.logit_scale.exp() * (text_embs @ image_embs.T)).diag()
    reward = PickScore(PickScoreOptions(model=str(tiny_clip), processor=str(tiny_clip)))
    scores = reward(Media("image", images()), PROMPTS)
    torch.testing.assert_close(scores["pickscore"], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores["score"], expected / 26, atol=1e-5, rtol=0)


def test_the_aesthetic_score_is_the_laion_mlp_on_the_unit_image_embedding(tiny_clip, tmp_path):
    torch.manual_seed(2)
    laion = torch.nn.Module()
    laion.layers = aesthetic_head(24)  # saved as LAION's MLP module saves it: keys layers.0.weight, ...
    torch.save(laion.state_dict(), tmp_path / "predictor.pth")
    model, processor, pictures = reference_inputs(tiny_clip)
    with torch.no_grad():
        embed = projected(model.get_image_features(**processor(images=pictures, return_tensors="pt")))
        expected = laion.layers.eval()(embed / embed.norm(dim=-1, keepdim=True))[:, 0]
    reward = AestheticScore(AestheticOptions(predictor=str(tmp_path / "predictor.pth"), model=str(tiny_clip)))
    torch.testing.assert_close(reward(Media("image", images()), PROMPTS)["score"], expected, atol=1e-5, rtol=0)
    assert list(laion.state_dict())[:2] == ["layers.0.weight", "layers.0.bias"]
    assert [k for k in laion.state_dict() if k.endswith("weight")] == [f"layers.{i}.weight" for i in (0, 2, 4, 6, 7)]


def test_hpsv2_is_its_references_formula(tmp_path):
    """HPSv2's img_score.py: open_clip's preprocess_val on the PIL image, the model's normalised features, the
    diagonal of image_features @ text_features.T; its checkpoint holds the weights under 'state_dict'."""
    import json

    import open_clip

    from gyremedia_rewards.preference import HPSv2, HPSv2Options

    config = tmp_path / "tiny-hps-clip.json"
    config.write_text(
        json.dumps(
            {
                "embed_dim": 32,
                "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8},
                "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
            }
        )
    )
    open_clip.add_model_config(config)
    torch.manual_seed(3)
    model, _, preprocess_val = open_clip.create_model_and_transforms("tiny-hps-clip", pretrained=None)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "hps.pt")
    model.eval()
    pixels = (images() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    with torch.no_grad():
        image = torch.stack([preprocess_val(Image.fromarray(p)) for p in pixels])
        image_features, text_features, _ = model(image, open_clip.get_tokenizer("tiny-hps-clip")(PROMPTS))
        expected = torch.diagonal(image_features @ text_features.T)
    reward = HPSv2(HPSv2Options(checkpoint=str(tmp_path / "hps.pt"), model=str(config)))
    torch.testing.assert_close(reward(Media("image", images()), PROMPTS)["score"], expected, atol=1e-5, rtol=0)
