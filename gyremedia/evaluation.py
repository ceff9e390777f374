"""Fixed-seed evaluation: the same prompts and noise every time, so two models compare sample by sample."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from gyremedia.config import COMPONENT_SETTINGS, ResolvedConfig, Selected
from gyremedia.data import Prompt, PromptSource
from gyremedia.interfaces import Generated
from gyremedia.rollout import Media
from gyremedia.scoring import FRAME_SCORES, Scorer


def eval_prompts(config: ResolvedConfig) -> list[Prompt]:
    """``eval.prompts_file`` and ``eval.dataset``, else ``data.eval_prompts``, else the training prompts: records,
    so the rewards see their fields in evaluation as in training."""
    data, ev = config.core.data, config.core.eval
    if ev.prompts_file or ev.dataset:
        return PromptSource([], ev.prompts_file, data.prompt_column, ev.dataset, ev.split).prompts
    if data.eval_prompts:
        return PromptSource(data.eval_prompts).prompts
    return training_prompts(config).prompts


def training_prompts(config: ResolvedConfig) -> PromptSource:
    """``data.prompts``, ``data.prompts_file`` and ``data.dataset``, as records."""
    data = config.core.data
    return PromptSource(data.prompts, data.prompts_file, data.prompt_column, data.dataset, data.split)


@dataclass
class EvalResult:
    """Per-sample scores of one evaluation: ``scores[key]`` is a ``[N]`` tensor (NaN: not applicable)."""

    prompts: list[str]
    media: Media
    scores: dict[str, torch.Tensor]
    generated: Generated | None = None  # the policy's samples (final states, token ids), for further measurements
    preference: torch.Tensor | None = None  # the weights a preference-conditioned policy was evaluated at

    def means(self, prefix: str = "eval/") -> dict[str, float]:
        """Each score's :func:`summary` value, and the in-group diversity."""
        return {
            **{f"{prefix}{k}": summary(k, v) for k, v in self.scores.items()},
            f"{prefix}diversity": in_group_diversity(self.media, self.prompts),
        }


def summary(key: str, values: torch.Tensor) -> float:
    """A score's mean over the samples it applies to; ``<reward>/dropped`` a count, as in training."""
    return float(values.sum()) if key.endswith("/dropped") else nanmean(values)


def in_group_diversity(media: Media, prompts: list[str]) -> float:
    """How varied a model's answers to one prompt are (different seeds), averaged over prompts; 0 means
    mode collapse. Tensors: the mean pairwise RMS distance between a prompt's samples. Text: the share of
    its samples beyond the first that are distinct, ``(distinct - 1) / (n - 1)``."""
    if isinstance(media.data, list):
        shares = []
        for prompt in dict.fromkeys(prompts):
            answers = [media.data[i] for i, p in enumerate(prompts) if p == prompt]
            if len(answers) > 1:
                shares.append((len(set(answers)) - 1) / (len(answers) - 1))
        return sum(shares) / len(shares) if shares else math.nan
    flat = media.data.detach().float().flatten(1).cpu()
    distances = []
    for prompt in dict.fromkeys(prompts):
        rows = flat[[i for i, p in enumerate(prompts) if p == prompt]]
        if len(rows) > 1:
            pairwise = torch.cdist(rows, rows) / math.sqrt(rows.shape[1])
            distances.append(pairwise.sum() / (len(rows) * (len(rows) - 1)))
    return float(torch.stack(distances).mean()) if distances else math.nan


def nanmean(values: torch.Tensor) -> float:
    values = values[~torch.isnan(values)]
    return float(values.mean()) if len(values) else math.nan


def score(
    rewards: dict[str, Any],
    media: Media,
    prompts: list[str],
    selected: Sequence[Selected] = (),
    when: str = "during evaluation",
) -> dict[str, torch.Tensor]:
    """``{reward: score, reward/component: values}`` for every sample, each reward under its ``timeout`` and
    ``on_failure`` as selected (``selected``, by name; default: fail, no timeout), as in training. A reward that
    may drop also gives ``reward/dropped`` (1 where a failure or NaN dropped the sample's score)."""
    by_name = {s.name: s for s in selected}
    chosen = [by_name.get(name) or Selected("reward", name, None, COMPONENT_SETTINGS["reward"]()) for name in rewards]
    scorer = Scorer(chosen, rewards)
    scored = scorer.collect(scorer.submit(media, prompts), prompts, when)
    scores = {}
    for name, components in scored.components.items():
        for key, value in components.items():
            if key != FRAME_SCORES:  # per-frame scores train per-frame advantages; evaluations report the means
                scores[name if key == "score" else f"{name}/{key}"] = value
        if scorer.may_drop(name):
            scores[f"{name}/dropped"] = scored.dropped[name].float()
    return scores


def selected_rewards(config: ResolvedConfig) -> list[Selected]:
    """The run's rewards and its gold rewards (named ``gold/<name>``, as :func:`gyremedia.runtime.runs.build_scoring`
    builds them), with their failure policies."""
    return [*config.rewards, *(dataclasses.replace(s, name=f"gold/{s.name}") for s in config.gold_rewards)]


def evaluate(
    config: ResolvedConfig,
    backbone: Any,
    sampler: Any,
    rewards: dict[str, Any],
    preference: torch.Tensor | None = None,
    step: int | None = None,
) -> EvalResult:
    """Score ``eval.samples`` fixed-seed samples of the eval prompts (cycled). A preference-conditioned model is
    evaluated at ``preference`` (``gyremedia_eval_preference``). ``step`` names the evaluation in a reward's error."""
    ev, rollout = config.core.eval, config.core.rollout
    held_out = eval_prompts(config)
    prompts: list[str] = [held_out[i % len(held_out)] for i in range(ev.samples)]
    backbone.trainable_module().eval()
    generated = backbone.generate(
        prompts,
        seed=ev.seed,
        sampler=sampler,
        num_steps=ev.num_steps or rollout.num_steps,
        guidance_scale=rollout.guidance_scale,
        preference=preference,
    )
    when = "during evaluation" if step is None else f"in the step-{step} evaluation"
    scores = score(rewards, generated.media, prompts, selected_rewards(config), when)
    return EvalResult(prompts, generated.media, scores, generated=generated, preference=preference)


def hacking_warning(
    step: int, previous: dict[str, float], current: dict[str, float], proxy: str, gold: list[str], tolerance: float
) -> str | None:
    """The reward-hacking warning between two evaluations' metrics, or None: the ``proxy`` metric rose by more than
    ``tolerance`` while a ``gold`` metric fell by more than it."""
    if proxy not in previous or proxy not in current or current[proxy] - previous[proxy] <= tolerance:
        return None
    fallen = [k for k in gold if k in previous and k in current and current[k] < previous[k] - tolerance]
    if not fallen:
        return None
    return f"reward hacking? at step {step} the proxy {proxy} rose {previous[proxy]:.4f} -> {current[proxy]:.4f} " + (
        "while " + ", ".join(f"{k} fell {previous[k]:.4f} -> {current[k]:.4f}" for k in fallen)
    )


def accuracy_key(config: ResolvedConfig) -> str:
    """The score reported as accuracy: ``eval.metric``, else the first reward's score."""
    return config.core.eval.metric or config.rewards[0].name


def paired_difference(base: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    """Mean of ``trained - base`` over paired samples (same prompt and noise) with a normal 95% interval, in
    the score's own units."""
    diff = (trained - base).double()
    diff = diff[~torch.isnan(diff)]
    mean = float(diff.mean())
    half = 1.96 * float(diff.std(unbiased=True)) / math.sqrt(len(diff)) if len(diff) > 1 else math.inf
    return {"mean": mean, "ci95_low": mean - half, "ci95_high": mean + half, "samples": len(diff)}


def paired_gain(base: torch.Tensor, trained: torch.Tensor) -> dict[str, float]:
    """:func:`paired_difference` of a score in [0, 1], in percentage points."""
    d = paired_difference(base, trained)
    return {
        "points": 100 * d["mean"],
        "ci95_low": 100 * d["ci95_low"],
        "ci95_high": 100 * d["ci95_high"],
        "samples": d["samples"],
    }


def save_grid(media: Media, prompts: list[str], path: Path, count: int) -> Path | None:
    """A captioned grid of the first ``count`` samples: a PNG of images, an animated GIF of videos, a PNG of
    spectrograms beside one wav file per sample (in a folder named like ``path``), a text file of prompts and
    completions (``path`` with its suffix changed). Returns the file written."""
    from gyremedia.media_io import save_image_grid, save_spectrogram_grid, save_video_grid, save_wavs

    if media.kind == "text":
        path = Path(path).with_suffix(".txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "".join(f"{prompt!r} -> {completion!r}\n" for prompt, completion in zip(prompts[:count], media.data))
        )
        return path
    data = cast(torch.Tensor, media.data)  # the other kinds are tensors
    if media.kind == "image":
        save_image_grid(data[:count], prompts[:count], path)
        return path
    if media.kind == "video":
        path = Path(path).with_suffix(".gif")
        save_video_grid(data[:count], prompts[:count], path, fps=media.meta.get("fps", 4))
        return path
    if media.kind == "audio":
        rate = media.meta["sample_rate"]
        save_wavs(data[:count], rate, Path(path).with_suffix(""), [f"{i:02d}" for i in range(min(count, len(data)))])
        save_spectrogram_grid({"": data[:count]}, prompts[:count], path, sample_rate=rate)
        return path
    return None
