"""``speech_enhancement``: generative speech enhancement by conditional flow matching in the complex STFT domain.

The state is the compressed complex spectrogram of the clean estimate (``[B, 2, F, T]``,
:mod:`gyremedia_speech.stft`); it flows from Gaussian noise (``sigma = 1``) to the clean speech
(``sigma = 0``), conditioned on the noisy utterance's spectrogram, which is concatenated to the state's
channels. Flow convention as everywhere in gyremedia: ``x_sigma = (1 - sigma) x0 + sigma eps`` and the
policy predicts the velocity ``v = eps - x0``. The network itself estimates the clean speech as a correction
of the noisy input, ``x0^ = noisy + unet(...)``, and the velocity follows: ``v = (x_sigma - x0^) / sigma``
(``x0 = x_sigma - sigma v``), so an untrained enhancer already returns its input rather than noise, and an
Euler step is an interpolation toward ``x0^`` that cannot overshoot. The network is a stock diffusers
``UNet2DModel``; it sees the
4-channel input folded into ``patch x patch`` blocks (``pixel_unshuffle``), which keeps the full time-frequency
resolution in the channels and costs ``patch^2`` times less than running at full size.
A group is several enhancements of the same noisy utterance (different noise), so every sampler and
objective works unchanged. Prompts are NoisySpeech utterances (:mod:`gyremedia_speech.world`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gyremedia.backbones.denoising import DenoisingPolicy
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy
from gyremedia.interfaces import BuildContext
from gyremedia.options import existing_folder, option
from gyremedia.rollout import Media
from gyremedia_speech.stft import STFTSettings
from gyremedia_speech.world import Utterance, parse_prompt

NETWORK_FILE = "enhancer.json"  # how the network is applied: the patch size (STFT settings: stft.json)
MIN_SIGMA = 1e-4  # the velocity divides by sigma; below this the state is the clean estimate anyway


@dataclass
class TinyEnhancerOptions:
    """Sizes of a randomly initialised network (used when ``pretrained`` is unset)."""

    block_out_channels: list[int] = option(default_factory=lambda: [48, 64, 96], help="UNet channels per level")
    layers_per_block: int = option(1, ge=1, help="resnet blocks per level")
    patch: int = option(4, ge=1, help="time-frequency blocks folded into channels (pixel_unshuffle)")
    seed: int = option(0, ge=0, help="seed of the random weights")


@dataclass
class SpeechEnhancementOptions:
    pretrained: str | None = option(
        None,
        check=existing_folder("a folder written by `python -m gyremedia_speech.pretrain`"),
        help="folder written by `python -m gyremedia_speech.pretrain` or a speech export; None builds `tiny`",
    )
    tiny: TinyEnhancerOptions = field(default_factory=TinyEnhancerOptions)
    lora: LoraOptions = field(default_factory=lambda: LoraOptions(target_modules=["conv1", "conv2"]))
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")


def build_tiny_enhancer(options: TinyEnhancerOptions, stft: STFTSettings):
    """A random ``UNet2DModel`` over ``[state, noisy]`` spectrograms folded into ``patch`` blocks."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UNet2DModel

    channels, bins, frames = stft.shape
    if bins % (options.patch * 2 ** (len(options.block_out_channels) - 1)) or frames % options.patch:
        raise ValueError(
            f"a {bins}x{frames} spectrogram does not fold into {options.patch}-blocks over "
            f"{len(options.block_out_channels)} UNet levels"
        )
    torch.manual_seed(options.seed)
    levels = len(options.block_out_channels)
    network = UNet2DModel(
        sample_size=(bins // options.patch, frames // options.patch),
        in_channels=2 * channels * options.patch**2,
        out_channels=channels * options.patch**2,
        block_out_channels=tuple(options.block_out_channels),
        down_block_types=("DownBlock2D",) * levels,
        up_block_types=("UpBlock2D",) * levels,
        layers_per_block=options.layers_per_block,
        norm_num_groups=8,
        add_attention=False,
    )
    return network, FlowMatchEulerDiscreteScheduler(shift=1.0), {"patch": options.patch}


@lru_cache(maxsize=2048)
def noisy_and_clean(utterance: Utterance) -> tuple[np.ndarray, np.ndarray]:
    """The utterance's ``(noisy, clean)`` waveforms, made once per process."""
    return utterance.pair()


class SpeechEnhancementBackbone(TransformerPolicy, DenoisingPolicy):
    """A flow-matching speech enhancer seen as a policy over denoising transitions of the clean spectrogram."""

    media_kind = "audio"
    prediction = "velocity"

    def __init__(self, options: SpeechEnhancementOptions, context: BuildContext) -> None:
        self.options = options
        self.device = context.device
        if options.pretrained:
            from diffusers import FlowMatchEulerDiscreteScheduler, UNet2DModel

            folder = Path(options.pretrained)
            if not (folder / NETWORK_FILE).is_file():
                raise FileNotFoundError(
                    f"backbone.pretrained={options.pretrained!r} has no {NETWORK_FILE}: point it at a "
                    "folder written by `python -m gyremedia_speech.pretrain` or by a speech export"
                )
            self.stft = STFTSettings.load(folder)
            self.transformer = UNet2DModel.from_pretrained(folder / "unet")
            self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler")
            self.network = json.loads((folder / NETWORK_FILE).read_text())
        else:
            self.stft = STFTSettings()
            self.transformer, self.scheduler, self.network = build_tiny_enhancer(options.tiny, self.stft)
        self.patch = int(self.network["patch"])
        self.transformer.to(self.device)
        self._prepare_training(options.lora, options.gradient_checkpointing, context.mixed_precision)

    # ------------------------------------------------------------------ policy

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``noisy [B, 2, F, T]``: the compressed spectrogram of each prompt's noisy utterance."""
        noisy = np.stack([noisy_and_clean(parse_prompt(p))[0] for p in prompts])
        return {"noisy": self.stft.to_spec(torch.from_numpy(noisy)).to(self.device)}

    def sample_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        return torch.stack([torch.randn(self.stft.shape, generator=g) for g in generators]).to(self.device)

    def predict(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The velocity of spectrogram states ``x [B, 2, F, T]`` at ``sigma`` (scalar or ``[B]``)."""
        if guidance_scale != 1.0:
            raise ValueError(
                "speech_enhancement has no unconditional branch for guidance: set rollout.guidance_scale=1"
            )
        noisy = conditions["noisy"].to(x.dtype)
        inputs = F.pixel_unshuffle(torch.cat([x, noisy], dim=1), self.patch)
        timestep = (sigma * 1000).to(x.dtype).reshape(-1).expand(x.shape[0])
        clean = noisy + F.pixel_shuffle(self._forward(reference, sample=inputs, timestep=timestep), self.patch)
        return (x - clean) / sigma.to(x.dtype).reshape(-1, 1, 1, 1).clamp(min=MIN_SIGMA)

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        """Audio media ``[B, 1, N]`` in [-1, 1] at the STFT's sample rate."""
        wave = self.stft.to_wave(final.float()).clamp(-1, 1)
        return Media("audio", wave[:, None], {"sample_rate": self.stft.sample_rate})

    # ------------------------------------------------------------------ export

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """Write ``unet/`` (a stock ``UNet2DModel``; only the LoRA adapters, in ``unet_lora/``, when ``merge_lora``
        is false), ``scheduler/``, ``stft.json``, ``enhancer.json`` and a README with a plain-torch enhance loop."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.lora_enabled and not merge_lora:
            self.transformer.save_lora_adapter(out_dir / "unet_lora")
        else:
            self._merged_transformer().save_pretrained(out_dir / "unet")
        self.scheduler.save_pretrained(out_dir / "scheduler")
        self.stft.save(out_dir)
        (out_dir / NETWORK_FILE).write_text(json.dumps(self.network, indent=1))
        (out_dir / "README.md").write_text(USAGE.replace("STFT_SETTINGS", json.dumps(asdict(self.stft))))


USAGE = """# Trained with gyremedia: a flow-matching speech enhancer (16 kHz mono)

`unet/` is a stock diffusers `UNet2DModel`; `stft.json` holds the STFT settings (STFT_SETTINGS) and
`enhancer.json` the patch size the network folds the spectrogram into. The network estimates the clean
spectrogram as a correction of the noisy one. Enhance with torch and diffusers
alone (Euler steps of the flow from noise to clean speech on the scheduler's noise levels, conditioned on
the noisy clip):

```python
import json, torch, torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler, UNet2DModel

folder = "THIS_FOLDER"
unet = UNet2DModel.from_pretrained(f"{folder}/unet").eval()
scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(f"{folder}/scheduler")
stft, patch = json.load(open(f"{folder}/stft.json")), json.load(open(f"{folder}/enhancer.json"))["patch"]
window = torch.hann_window(stft["n_fft"])

def to_spec(wave):  # [B, N] -> [B, 2, F, T], amplitude-compressed
    s = torch.stft(wave, stft["n_fft"], stft["hop_length"], window=window, return_complex=True)
    s = stft["scale"] * s.abs() ** stft["exponent"] * torch.exp(1j * s.angle())
    return torch.view_as_real(s).permute(0, 3, 1, 2)

def to_wave(spec):  # the inverse
    c = torch.view_as_complex(spec.permute(0, 2, 3, 1).contiguous())
    s = torch.polar((c.abs() / stft["scale"]) ** (1 / stft["exponent"]), c.angle())
    return torch.istft(s, stft["n_fft"], stft["hop_length"], window=window, length=stft["clip_samples"])

@torch.no_grad()
def enhance(noisy, steps=10, generator=None):  # noisy: [B, clip_samples] floats in [-1, 1]
    condition = to_spec(noisy)
    x = torch.randn(condition.shape, generator=generator)
    scheduler.set_timesteps(steps)
    sigmas = scheduler.sigmas
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        inputs = F.pixel_unshuffle(torch.cat([x, condition], 1), patch)
        clean = condition + F.pixel_shuffle(unet(inputs, torch.full((len(x),), float(sigma) * 1000)).sample, patch)
        x = x + (sigma_next - sigma) * (x - clean) / sigma  # Euler step on the velocity (x - clean) / sigma
    return to_wave(x).clamp(-1, 1)
```

or continue training with `backbone.name=speech_enhancement backbone.pretrained=THIS_FOLDER`.
"""
