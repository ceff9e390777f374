"""What a person wants to hear and see after a speech-enhancement run: the noisy and clean clips of the
first held-out utterances as wav files beside the base and trained enhancements that the evaluation
wrote (``samples/before/``, ``samples/after/``), and one spectrogram grid of all four."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gyremedia.evaluation import eval_prompts
from gyremedia.media_io import read_wav, save_spectrogram_grid, save_wavs
from gyremedia.rollout import Media
from gyremedia_speech.backbone import noisy_and_clean
from gyremedia_speech.world import parse_prompt


def write_comparison(samples: Path, trained: Media, prompts: list[str], count: int) -> Path:
    """``samples/noisy/``, ``samples/clean/`` and ``samples/compare.png`` (rows noisy / base / trained / clean)
    for the first ``count`` prompts; the base row comes from ``samples/before/`` when that evaluation ran."""
    count = min(count, len(prompts), len(trained.data))
    rate = trained.meta["sample_rate"]
    pairs = [noisy_and_clean(parse_prompt(p)) for p in prompts[:count]]
    noisy, clean = (torch.from_numpy(np.stack(waves))[:, None] for waves in zip(*pairs))
    names = [f"{i:02d}" for i in range(count)]
    save_wavs(noisy, rate, samples / "noisy", names)
    save_wavs(clean, rate, samples / "clean", names)
    rows = {"noisy": noisy}
    before = [samples / "before" / f"{name}.wav" for name in names]
    if all(path.is_file() for path in before):
        rows["base"] = torch.stack([read_wav(path)[0] for path in before])
    rows["trained"] = trained.data[:count]
    rows["clean"] = clean
    path = samples / "compare.png"
    save_spectrogram_grid(rows, prompts[:count], path, sample_rate=rate)
    return path


def comparison_after_training(state, media: Media) -> None:
    """At the run's last evaluation, write :func:`write_comparison` into its ``samples`` folder."""
    if state.step == state.config.core.train.steps:
        prompts = eval_prompts(state.config)
        write_comparison(state.run_dir / "samples", media, prompts, state.config.core.eval.grid_size)
