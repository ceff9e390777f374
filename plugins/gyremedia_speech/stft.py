"""The complex STFT representation the speech policy works in, and its exact inverse.

A waveform ``[B, N]`` becomes ``[B, 2, F, T]`` (real and imaginary parts) of the amplitude-compressed
spectrogram ``c = scale * |X|^exponent * exp(i angle X)`` (SGMSE's compression: speech's dynamic range
shrinks, so quiet phonemes weigh in the flow loss). With ``n_fft = 254`` and a 10 ms hop at 16 kHz a clip
of 20,320 samples is 128 bins by 128 frames. ``torch.istft`` with the same Hann window inverts it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gyremedia_speech.world import CLIP_SAMPLES, SAMPLE_RATE

FILE = "stft.json"


@dataclass(frozen=True)
class STFTSettings:
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 254
    hop_length: int = 160
    exponent: float = 0.5  # amplitude compression |X|^exponent
    scale: float = 2.0  # clean clips then have a spread of about 0.5
    clip_samples: int = CLIP_SAMPLES

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(2, bins, frames)`` of one clip."""
        return 2, self.n_fft // 2 + 1, self.clip_samples // self.hop_length + 1

    def save(self, folder: Path) -> None:
        (Path(folder) / FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, folder: Path) -> "STFTSettings":
        return cls(**json.loads((Path(folder) / FILE).read_text()))

    def _window(self, device: torch.device) -> torch.Tensor:
        return torch.hann_window(self.n_fft, device=device)

    def to_spec(self, wave: torch.Tensor) -> torch.Tensor:
        """``[B, N]`` waveform -> ``[B, 2, F, T]`` compressed complex spectrogram."""
        spec = torch.stft(
            wave.float(),
            self.n_fft,
            self.hop_length,
            window=self._window(wave.device),
            center=True,
            return_complex=True,
        )
        magnitude = spec.abs()
        compressed = self.scale * magnitude.pow(self.exponent) * torch.exp(1j * spec.angle())
        return torch.view_as_real(compressed).permute(0, 3, 1, 2).contiguous()

    def to_wave(self, spec: torch.Tensor) -> torch.Tensor:
        """``[B, 2, F, T]`` -> ``[B, N]`` waveform of :attr:`clip_samples` samples (the inverse of :meth:`to_spec`)."""
        compressed = torch.view_as_complex(spec.float().permute(0, 2, 3, 1).contiguous())
        magnitude = (compressed.abs() / self.scale).pow(1 / self.exponent)
        complex_spec = torch.polar(magnitude, compressed.angle())
        return torch.istft(
            complex_spec,
            self.n_fft,
            self.hop_length,
            window=self._window(spec.device),
            center=True,
            length=self.clip_samples,
        )
