"""Writing media for people to look at and listen to: captioned image grids, animated video grids, audio
files with spectrogram grids, and metric curves."""

from __future__ import annotations

import json
import logging
import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

logger = logging.getLogger("gyremedia")


def eight_bit(pixels: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] (any layout) as uint8 on the CPU, rounded from float32: what people see and what 8-bit
    reward models read."""
    return (pixels.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a line that does not parse (half-written at a power loss or a full
    disk) is skipped with a warning."""
    records = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            logger.warning("%s: line %d is not a whole JSON record (a write cut short?): skipped", path, number)
    return records


def image_grid(
    images: torch.Tensor, captions: list[str], *, columns: int = 8, cell: int = 96, caption_lines: int = 3
) -> Image.Image:
    """``[N, 3, H, W]`` images in [0, 1] as one picture, each upscaled (nearest) with its caption below."""
    font = ImageFont.load_default()
    line_height = 11
    rows = math.ceil(len(images) / columns)
    width, height = columns * cell, rows * (cell + caption_lines * line_height + 4)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    pixels = eight_bit(images).permute(0, 2, 3, 1).numpy()
    for i, (image, caption) in enumerate(zip(pixels, captions)):
        x, y = (i % columns) * cell, (i // columns) * (cell + caption_lines * line_height + 4)
        canvas.paste(
            Image.fromarray(np.ascontiguousarray(image)).resize((cell - 4, cell - 4), Image.Resampling.NEAREST),
            (x + 2, y + 2),
        )
        for j, line in enumerate(textwrap.wrap(caption, width=cell // 6)[:caption_lines]):
            draw.text((x + 2, y + cell + j * line_height), line, fill="black", font=font)
    return canvas


def save_image_grid(images: torch.Tensor, captions: list[str], path: Path, **layout) -> None:
    """Save ``[N, 3, H, W]`` images in [0, 1] as a captioned grid (see :func:`image_grid`)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, captions, **layout).save(path)


def save_video_grid(videos: torch.Tensor, captions: list[str], path: Path, *, fps: float = 4, **layout) -> None:
    """Save ``[N, T, 3, H, W]`` videos in [0, 1] as one looping animated GIF of captioned grids."""
    frames = [image_grid(videos[:, t], captions, **layout) for t in range(videos.shape[1])]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)


def save_wavs(audio: torch.Tensor, sample_rate: int, folder: Path, names: list[str]) -> list[Path]:
    """Save ``[N, C, S]`` audio in [-1, 1] as 16-bit PCM ``folder/<name>.wav`` files (one per name)."""
    import wave

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pcm = (audio.detach().float().cpu().clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    paths = []
    for samples, name in zip(pcm, names):
        path = folder / f"{name}.wav"
        with wave.open(str(path), "wb") as out:
            out.setnchannels(samples.shape[0])
            out.setsampwidth(2)
            out.setframerate(sample_rate)
            out.writeframes(np.ascontiguousarray(samples.T).tobytes())
        paths.append(path)
    return paths


def read_wav(path: Path) -> tuple[torch.Tensor, int]:
    """A 16-bit PCM wav file as ``[C, S]`` floats in [-1, 1] and its sample rate."""
    import wave

    with wave.open(str(path), "rb") as source:
        frames = np.frombuffer(source.readframes(source.getnframes()), dtype=np.int16)
        channels, rate = source.getnchannels(), source.getframerate()
    return torch.from_numpy(frames.reshape(-1, channels).T / 32767).float(), rate


def save_spectrogram_grid(
    rows: dict[str, torch.Tensor], captions: list[str], path: Path, *, sample_rate: int, n_fft: int = 512
) -> None:
    """Log-magnitude spectrograms (dB, first channel) of audio ``[N, C, S]``: one row per entry of ``rows``
    (e.g. noisy / base / trained / clean), one column per sample, captioned, on one colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(captions)
    figure, axes = plt.subplots(len(rows), count, figsize=(2.2 * count, 1.8 * len(rows)), squeeze=False)
    window = torch.hann_window(n_fft)
    for r, (label, audio) in enumerate(rows.items()):
        for c in range(count):
            spectrum = torch.stft(
                audio[c, 0].detach().float().cpu(), n_fft, n_fft // 4, window=window, return_complex=True
            ).abs()
            decibels = 20 * torch.log10(spectrum.clamp(min=1e-5))
            axes[r][c].imshow(
                decibels.numpy(),
                origin="lower",
                aspect="auto",
                vmin=-80,
                vmax=20,
                cmap="magma",
                extent=(0, audio.shape[-1] / sample_rate, 0, sample_rate / 2000),
            )
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([] if c else [0, sample_rate // 4000])
            if c == 0:
                axes[r][c].set_ylabel(f"{label}\nkHz", fontsize=8)
            if r == 0:
                axes[r][c].set_title("\n".join(textwrap.wrap(captions[c], 28)[:3]), fontsize=6)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_metrics(metrics_file: Path, path: Path, eval_keys: list[str], keys: list[str] | None = None) -> None:
    """Plot the training reward and the given evaluation scores over steps from a ``metrics.jsonl`` file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(metrics_file)
    keys = keys or ["reward"]
    eval_keys = [k for k in eval_keys if any(k in r for r in records)]
    figure, axes = plt.subplots(1, 1 + bool(eval_keys), figsize=(5 + 5 * bool(eval_keys), 3.5), squeeze=False)
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            steps, values = zip(*points)
            axes[0][0].plot(steps, values, label=key, alpha=0.5)
            window = max(1, len(values) // 10)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            axes[0][0].plot(steps[window - 1 :], smooth, label=f"{key} (mean of {window})")
    axes[0][0].set(xlabel="step", ylabel="training reward", title="reward during training")
    axes[0][0].legend(fontsize=7)
    if eval_keys:
        for key in eval_keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            axes[0][1].plot(*zip(*points), marker="o", label=key)
        axes[0][1].set(xlabel="step", title="evaluation (fixed seeds)")
        axes[0][1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_pareto_front(front: list[dict], names: list[str], path: Path, base: dict[str, float] | None = None) -> None:
    """Reward ``names[0]`` against ``names[1]`` at each swept preference, labelled with its weights
    (and the base model's point, when known)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4.5))
    x, y = [p[names[0]] for p in front], [p[names[1]] for p in front]
    axis.plot(x, y, marker="o", label="trained model, swept preference")
    if base is not None:
        axis.plot([base[names[0]]], [base[names[1]]], marker="s", color="grey", linestyle="none", label="base model")
        axis.legend(fontsize=8)
    for point, xi, yi in zip(front, x, y):
        axis.annotate(
            "(" + ", ".join(f"{w:.2f}" for w in point["weights"]) + ")",
            (xi, yi),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 4),
        )
    axis.set(xlabel=names[0], ylabel=names[1], title="Pareto front (preference weights in brackets)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
