"""A tiny random-weight transformers CLIP (model and processor) saved as a folder, built offline: the stand-in for
PickScore's and the aesthetic predictor's CLIP in the reward parity tests and the recipes' config checks."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_clip(folder: Path, words: list[str]) -> Path:
    """A CLIPModel (towers of width 32, projection 24, 32-pixel images) whose tokenizer knows ``words``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from gyremedia.tiny.sd3 import build_clip_tokenizer

    tokenizer = build_clip_tokenizer(words, 77)
    config = CLIPConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        projection_dim=24,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder
