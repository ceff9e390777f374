"""Audio-text alignment under CLAP, loaded with transformers' stock classes from a local folder or hub id.

- ``clap`` (LAION CLAP, Wu et al. 2023; ``laion/clap-htsat-unfused`` by default, ``laion/larger_clap_general``
  and the other ``ClapModel`` checkpoints alike): the score is the cosine of the audio and prompt embeddings, the
  diagonal of ``audio_embeds @ text_embeds.T`` as transformers' ``ClapModel.forward`` (``modeling_clap.py``)
  computes it from ``get_audio_features`` / ``get_text_features``; ``clap_logit`` is that cosine times
  ``logit_scale_a.exp()``, the diagonal of its ``logits_per_audio`` (``logits_per_text`` uses ``logit_scale_t``).

The audio is prepared as transformers' documented usage feeds ``ClapProcessor``: mono (the mean of the channels),
float samples at the feature extractor's ``sampling_rate`` (48 kHz: resampled from ``media.meta["sample_rate"]``
with ``scipy.signal.resample_poly``), then its log-mel features (shorter clips repeated and padded to its
``max_length_s``, 10 s; a longer clip is cut at random by ``rand_trunc``, and fused checkpoints mark one clip of a
batch of short ones "longer" at random, both as the reference does). Prompts are padded to the longest and
truncated to the tokenizer's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gyremedia.interfaces import BuildContext
from gyremedia.options import option, pretrained_source
from gyremedia.rollout import Media
from gyremedia_rewards.preference import projected, reward_device


@dataclass
class ClapOptions:
    model: str = option(
        "laion/clap-htsat-unfused", check=pretrained_source, help="a ClapModel folder or hub id, with its ClapProcessor"
    )
    batch_size: int = option(32, ge=1, help="clips per forward pass")


def mono_waves(media: Media, rate: int) -> list[np.ndarray]:
    """Each clip of ``[B, C, N]`` audio media as mono float32 samples at ``rate`` Hz (what CLAP's feature
    extractor takes): the mean of the channels, resampled from ``media.meta["sample_rate"]``."""
    source = media.meta.get("sample_rate")
    if not source:
        raise ValueError("clap needs the audio's sample rate in media.meta['sample_rate']")
    waves = media.data.detach().float().mean(1).cpu().numpy()
    if int(source) != rate:
        from scipy.signal import resample_poly

        waves = resample_poly(waves, rate, int(source), axis=-1).astype(np.float32)
    return list(waves)


class ClapScore:
    """``score``: cos(audio, prompt) under CLAP; ``clap_logit``: ``logit_scale_a.exp()`` x that cosine."""

    kinds = {"audio"}

    def __init__(self, options: ClapOptions, context: BuildContext | None = None) -> None:
        from transformers import ClapModel, ClapProcessor

        self.device = reward_device(context)
        self.model = ClapModel.from_pretrained(options.model).to(self.device).eval().requires_grad_(False)
        self.processor = ClapProcessor.from_pretrained(options.model)
        self.batch_size = options.batch_size

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        # the processor's parts called directly: its own __call__ names the audio ``audios=`` before transformers 5
        # and ``audio=`` since, and before 5 passes every keyword to both parts
        features = self.processor.feature_extractor
        audio = features(
            mono_waves(media, features.sampling_rate), sampling_rate=features.sampling_rate, return_tensors="pt"
        ).to(self.device)
        audio["input_features"] = audio["input_features"].to(self.model.dtype)
        text = self.processor.tokenizer(
            [str(p) for p in prompts], padding=True, truncation=True, return_tensors="pt"
        ).to(self.device)
        audio_embeds = torch.nn.functional.normalize(projected(self.model.get_audio_features(**audio)), dim=-1)
        text_embeds = torch.nn.functional.normalize(projected(self.model.get_text_features(**text)), dim=-1)
        cosine = (audio_embeds * text_embeds).sum(-1)
        return {"score": cosine.float().cpu(), "clap_logit": (self.model.logit_scale_a.exp() * cosine).float().cpu()}
