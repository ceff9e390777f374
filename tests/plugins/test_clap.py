"""The CLAP reward on a tiny random-weight replica built offline from the same transformers classes, against
transformers' documented ``ClapModel`` usage: ``ClapProcessor(text=..., audio=..., sampling_rate=48000)`` on mono
48 kHz samples, then ``ClapModel.forward``'s normalised ``audio_embeds`` / ``text_embeds`` and ``logits_per_audio``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.signal import resample_poly

from gyremedia.rollout import Media
from gyremedia.scoring import call_reward
from gyremedia_rewards.clap import ClapOptions, ClapScore

PROMPTS = ["a dog barks", "rain on a roof", "a sine tone"]
RATE = 48_000  # CLAP's feature extractor rate


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory):
    """A ClapModel (a one-layer RoBERTa of width 32, a two-stage HTSAT on a 64-pixel spectrogram of 16 mel bins,
    projection 24) with different audio and text logit scales, and its ClapProcessor, saved as a folder."""
    from tokenizers import pre_tokenizers
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor, RobertaTokenizer

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # byte-level BPE with no merges: one token per byte
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = RobertaTokenizer(vocab=vocab, merges=[], model_max_length=32)
    config = ClapConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": 40,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        audio_config={
            "spec_size": 64,
            "num_mel_bins": 16,
            "window_size": 4,
            "depths": [1, 1],
            "num_attention_heads": [2, 2],
            "patch_embeds_hidden_size": 16,
            "hidden_size": 32,
        },
        projection_dim=24,
    )
    torch.manual_seed(0)
    model = ClapModel(config)
    with torch.no_grad():  # apart, so a test can tell which one scales logits_per_audio
        model.logit_scale_a.fill_(math.log(20.0))
        model.logit_scale_t.fill_(math.log(5.0))
    folder = tmp_path_factory.mktemp("tiny_clap")
    model.save_pretrained(folder)
    features = ClapFeatureExtractor(feature_size=16, sampling_rate=RATE, max_length_s=1, truncation="rand_trunc")
    ClapProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def clips(rate: int, channels: int) -> torch.Tensor:
    """Three 0.5 s clips ``[3, channels, N]`` in [-1, 1]: a 440 Hz tone, noise, a 1 kHz tone (a 0.3 s burst)."""
    t = torch.arange(rate // 2, dtype=torch.float64) / rate
    noise = torch.rand(channels, len(t), generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1
    burst = torch.sin(2 * math.pi * 1000 * t) * (t < 0.3)
    tone = torch.sin(2 * math.pi * 440 * t) * torch.linspace(1, 0.5, channels)[:, None]  # channels apart
    return torch.stack([tone, 0.3 * noise, burst.expand(channels, -1)]).float()


def reference(folder, waves: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' documented path: the cosine (diagonal of the normalised audio x text embeddings) and the
    diagonal of ``logits_per_audio`` for 48 kHz mono clips."""
    from transformers import ClapModel, ClapProcessor

    model, processor = ClapModel.from_pretrained(folder).eval(), ClapProcessor.from_pretrained(folder)
    inputs = processor(text=PROMPTS, audio=waves, sampling_rate=RATE, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    return (out.audio_embeds * out.text_embeds).sum(-1), out.logits_per_audio.diag()


def test_clap_is_the_cosine_of_its_references_embeddings(tiny_clap):
    stereo = clips(RATE, channels=2)
    cosine, logits = reference(tiny_clap, list(stereo.mean(1).numpy()))
    scores = ClapScore(ClapOptions(model=str(tiny_clap)))(Media("audio", stereo, {"sample_rate": RATE}), PROMPTS)
    torch.testing.assert_close(scores["score"], cosine, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores["clap_logit"], logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores["clap_logit"], 20 * scores["score"], atol=1e-5, rtol=0)  # logit_scale_a


def test_clap_resamples_the_audio_to_48_khz(tiny_clap):
    low = clips(16_000, channels=1)
    cosine, logits = reference(tiny_clap, [resample_poly(w, 3, 1) for w in low[:, 0].numpy()])
    reward = ClapScore(ClapOptions(model=str(tiny_clap)))
    scores = reward(Media("audio", low, {"sample_rate": 16_000}), PROMPTS)
    torch.testing.assert_close(scores["score"], cosine, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores["clap_logit"], logits, atol=1e-5, rtol=0)
    # the 16 kHz tone scores near the same tone made at 48 kHz, and far from its samples read as 48 kHz
    native = reward(Media("audio", clips(RATE, channels=1), {"sample_rate": RATE}), PROMPTS)["score"]
    misread = reward(Media("audio", low, {"sample_rate": RATE}), PROMPTS)["score"]
    assert (scores["score"] - native)[0].abs() < 0.1 * (misread - native)[0].abs()


def test_clap_scores_do_not_depend_on_the_batch_size(tiny_clap):
    media = Media("audio", clips(22_050, channels=2), {"sample_rate": 22_050})
    reward = ClapScore(ClapOptions(model=str(tiny_clap), batch_size=1))
    one = call_reward(reward, media, PROMPTS)
    reward.batch_size = len(PROMPTS)
    torch.testing.assert_close(call_reward(reward, media, PROMPTS), one, atol=1e-5, rtol=0)


def test_clap_needs_the_sample_rate(tiny_clap):
    with pytest.raises(ValueError, match="sample_rate"):
        ClapScore(ClapOptions(model=str(tiny_clap)))(Media("audio", clips(RATE, channels=1)), PROMPTS)
