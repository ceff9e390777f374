"""The offline tiny SD3 pipeline: its tokenizer and its determinism."""

import torch

from gyremedia.tiny.sd3 import DEFAULT_WORDS, TinySD3Options, build_clip_tokenizer, build_tiny_sd3_pipeline
from gyremedia_shapes.world import VOCABULARY


def test_every_listed_word_is_one_token_and_others_still_encode():
    for words in (DEFAULT_WORDS, VOCABULARY):
        tokenizer = build_clip_tokenizer(words, 16)
        for word in words:
            assert len(tokenizer(word).input_ids) == 3, word  # start, the word, end
    tokenizer = build_clip_tokenizer(VOCABULARY, 16)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("three blue triangles above a hexagon").input_ids)
    assert tokens[1:5] == ["three</w>", "blue</w>", "triangles</w>", "above</w>"]
    assert len(tokens) > 8  # the unknown word falls back to byte pieces


def test_build_is_deterministic_per_seed():
    small = dict(
        latent_size=4, vae_channels=[8], num_layers=1, attention_head_dim=8, text_hidden_size=16, text_layers=1
    )
    a = build_tiny_sd3_pipeline(TinySD3Options(**small, seed=3))
    b = build_tiny_sd3_pipeline(TinySD3Options(**small, seed=3))
    c = build_tiny_sd3_pipeline(TinySD3Options(**small, seed=4))
    first = lambda p: next(p.transformer.parameters())  # noqa: E731
    assert torch.equal(first(a), first(b)) and not torch.equal(first(a), first(c))
