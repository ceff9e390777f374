"""Speech quality rewards for audio media, computed from the media and the prompt alone.

Intrusive metrics (PESQ, ESTOI, SI-SDR) score against the clean reference that the prompt rebuilds
(:mod:`gyremedia_speech.world`); DNSMOS needs none. Every reward returns its metric as ``score``.
What each costs per second of 16 kHz audio: ``python benchmarks/speech_metrics.py`` measures it, and
docs/benchmarks.md lists the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
import torch

from gyremedia.options import option
from gyremedia.rollout import Media
from gyremedia_speech.backbone import noisy_and_clean
from gyremedia_speech.world import SAMPLE_RATE, parse_prompt


def _waves(media: Media) -> np.ndarray:
    """``[B, N]`` float64 samples of mono 16 kHz audio media."""
    rate = media.meta.get("sample_rate")
    if rate != SAMPLE_RATE or media.data.shape[1] != 1:
        raise ValueError(
            f"speech metrics score mono {SAMPLE_RATE} Hz audio, got {media.data.shape[1]} channels at {rate} Hz"
        )
    return media.data[:, 0].detach().double().cpu().numpy()


def _references(media: Media, prompts: list[str]) -> np.ndarray:
    """The clean utterance of each prompt, cut to the media's length."""
    clean = np.stack([noisy_and_clean(parse_prompt(p))[1] for p in prompts]).astype(np.float64)
    if clean.shape[1] != media.data.shape[-1]:
        raise ValueError(f"the prompts' clips have {clean.shape[1]} samples, the media {media.data.shape[-1]}")
    return clean


def si_sdr(estimate: torch.Tensor, reference: torch.Tensor, cap: float = 60.0) -> torch.Tensor:
    """Scale-invariant signal-to-distortion ratio in dB (Le Roux et al. 2019) of ``[B, N]`` signals, both
    made zero-mean; capped at ``cap`` (an exact copy would be +inf)."""
    estimate = estimate - estimate.mean(-1, keepdim=True)
    reference = reference - reference.mean(-1, keepdim=True)
    alpha = (estimate * reference).sum(-1, keepdim=True) / reference.pow(2).sum(-1, keepdim=True).clamp(min=1e-12)
    target = alpha * reference
    ratio = target.pow(2).sum(-1) / (estimate - target).pow(2).sum(-1).clamp(min=1e-20)
    return (10 * torch.log10(ratio.clamp(min=1e-20))).clamp(max=cap)


class SISDRReward:
    """``score``: SI-SDR in dB against the clean reference (capped at 60)."""

    kinds = {"audio"}

    def __init__(self, options=None, context=None) -> None:
        pass

    @torch.no_grad()
    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        values = si_sdr(torch.from_numpy(_waves(media)), torch.from_numpy(_references(media, prompts)))
        return {"score": values.float()}


class PESQReward:
    """``score``: wide-band PESQ (ITU-T P.862.2, MOS-LQO from about 1.0 to 4.64) against the clean reference,
    by the ITU reference implementation (the ``pesq`` package)."""

    kinds = {"audio"}

    def __init__(self, options=None, context=None) -> None:
        from pesq import pesq

        self._pesq = pesq

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        waves, clean = _waves(media), _references(media, prompts)
        return {"score": torch.tensor([self._pesq(SAMPLE_RATE, c, w, "wb") for c, w in zip(clean, waves)])}


class ESTOIReward:
    """``score``: extended short-time objective intelligibility (Jensen & Taal 2016), about 0 to 1, against the
    clean reference (``pystoi``)."""

    kinds = {"audio"}

    def __init__(self, options=None, context=None) -> None:
        from pystoi import stoi

        self._stoi = stoi

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        waves, clean = _waves(media), _references(media, prompts)
        return {
            "score": torch.tensor([float(self._stoi(c, w, SAMPLE_RATE, extended=True)) for c, w in zip(clean, waves)])
        }


# --------------------------------------------------------------------------- DNSMOS

DNSMOS_INPUT = int(9.01 * SAMPLE_RATE)  # the model's fixed input: 9.01 s
# DNSMOS P.835's published mapping of the network's raw outputs to MOS (non-personalised model)
DNSMOS_POLYNOMIALS = {
    "sig": (-0.08397278, 1.22083953, 0.0052439),
    "bak": (-0.13166888, 1.60915514, -0.39604546),
    "ovrl": (-0.06766283, 1.11546468, 0.04602535),
}


@lru_cache(maxsize=1)
def _dnsmos_session():
    """The DNSMOS P.835 ONNX model that the ``speechmos`` package ships, on onnxruntime's CPU provider."""
    from importlib.resources import files

    import onnxruntime

    model = files("speechmos") / "dnsmos_models" / "sig_bak_ovr.onnx"
    return onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def dnsmos_segments(wave: np.ndarray) -> np.ndarray:
    """The 9.01 s windows DNSMOS scores, hopped by 1 s: a shorter clip is first repeated (doubled until long
    enough), as Microsoft's DNSMOS script does."""
    while len(wave) < DNSMOS_INPUT:
        wave = np.concatenate([wave, wave])
    hops = int(np.floor(len(wave) / SAMPLE_RATE) - 9.01) + 1
    return np.stack(
        [
            wave[i * SAMPLE_RATE : i * SAMPLE_RATE + DNSMOS_INPUT]
            for i in range(hops)
            if i * SAMPLE_RATE + DNSMOS_INPUT <= len(wave)
        ]
    )


def dnsmos(waves: np.ndarray, batch_size: int = 1) -> dict[str, torch.Tensor]:
    """DNSMOS P.835 ``sig``, ``bak`` and ``ovrl`` of each ``[B, N]`` 16 kHz clip (segment means).

    One 9.01 s segment per run by default: the network's activations take 115 MiB a segment, so the speech
    quickstart's 16 took 1.8 GiB at once (benchmarks/real_shapes.py), and batching them was no faster here."""
    segments = [dnsmos_segments(w.astype(np.float32)) for w in waves]
    stacked = np.concatenate(segments)
    raw = np.concatenate(
        [
            _dnsmos_session().run(None, {"input_1": stacked[i : i + batch_size]})[0]
            for i in range(0, len(stacked), batch_size)
        ]
    )
    owners = np.repeat(np.arange(len(waves)), [len(s) for s in segments])
    result = {}
    for column, (name, coefficients) in enumerate(DNSMOS_POLYNOMIALS.items()):
        mos = np.polyval(coefficients, raw[:, column])
        result[name] = torch.from_numpy(np.bincount(owners, mos) / np.bincount(owners)).float()
    return result


@dataclass
class DNSMOSOptions:
    score: Literal["ovrl", "sig", "bak"] = option(
        "ovrl", help="which DNSMOS P.835 rating is the score: ovrl (overall), sig (speech) or bak (background)"
    )


class DNSMOSReward:
    """``score`` plus ``sig``, ``bak`` and ``ovrl``: DNSMOS P.835 (Reddy et al. 2022), a non-intrusive MOS predictor
    (1 to 5) run on onnxruntime from the model files of the ``speechmos`` package."""

    kinds = {"audio"}

    def __init__(self, options: DNSMOSOptions, context=None) -> None:
        self.score = options.score
        _dnsmos_session()

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        values = dnsmos(_waves(media))
        return {"score": values[self.score], **values}
