"""Rollouts sampled and scored once, saved to a folder, and trained on for many epochs (``gyremedia rollout``).

A sampler-free objective (GDRO, or any forward-process one) trains from clean samples and their rewards alone,
so the sampling that dominates an online run's cost can be paid once. ``gyremedia rollout CONFIG --out DIR``
runs the config's rollout and scoring stages for ``--steps`` steps and writes, per step and process, the
rollout's tensors (``step_00000_rank0.pt``: prompts, ids, conditions, final states, rewards; with
``--trajectories`` the whole trajectories and log-probs too), plus what a person reads: ``records.jsonl`` (one
line per sample: step, id, prompt, rewards), ``samples.png`` (the first step's images) and ``manifest.json``
(sizes, reward names, the model evaluations the sampling cost). ``data.offline=DIR`` (the ``offline`` plugin)
then serves step ``k`` of training the saved step ``k mod steps``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gyremedia.data import Prompt, prompt_fields
from gyremedia.rollout import Rollout

MANIFEST = "manifest.json"
RECORDS = "records.jsonl"


@dataclass
class Manifest:
    """What a folder of saved rollouts holds."""

    steps: int  # saved steps
    batch_size: int  # samples per step, over every process
    group_size: int
    processes: int  # files per step
    rewards: list[str]  # the reward names each sample was scored with
    trajectories: bool  # whole trajectories and log-probs (replaying objectives), or final states only
    model_evaluations: int  # the denoiser's forward rows the sampling cost (NFEs), all steps and processes

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(
                f"{folder} holds no saved rollouts ({MANIFEST} missing): write them with "
                f"`gyremedia rollout CONFIG --out {folder}`"
            )
        return cls(**json.loads(path.read_text()))


def step_file(folder: Path, step: int, rank: int) -> Path:
    return Path(folder) / f"step_{step:05d}_rank{rank}.pt"


def rollout_tensors(rollout: Rollout, trajectories: bool) -> dict[str, Any]:
    """What is saved of a scored rollout (on the CPU): every sample's prompt, ids, conditions, rewards, and its
    final state, or its whole trajectory with its log-probs."""

    def cpu(value: Any) -> Any:
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value

    saved = {
        "prompts": [str(p) for p in rollout.prompts],
        "prompt_fields": [json.dumps(dict(prompt_fields(p))) for p in rollout.prompts],  # a record's other fields
        "sample_ids": cpu(rollout.sample_ids),
        "group_ids": cpu(rollout.group_ids),
        "conditions": {k: cpu(v) for k, v in rollout.conditions.items()},
        "rewards": {k: cpu(v) for k, v in rollout.rewards.items()},
        "states": cpu(rollout.states if trajectories else rollout.final[:, None]),
    }
    if trajectories:
        saved |= {"log_probs": cpu(rollout.log_probs), "sigmas": cpu(rollout.sigmas)}
    return saved


def load_step(folder: Path, manifest: Manifest, step: int) -> Rollout:
    """Saved step ``step`` (every process's file, joined) as one scored rollout on the CPU."""
    parts = [torch.load(step_file(folder, step, rank), weights_only=True) for rank in range(manifest.processes)]
    return Rollout(
        prompts=[
            Prompt(text, json.loads(fields))
            for part in parts
            for text, fields in zip(part["prompts"], part["prompt_fields"])
        ],
        sample_ids=torch.cat([part["sample_ids"] for part in parts]),
        group_ids=torch.cat([part["group_ids"] for part in parts]),
        conditions={k: torch.cat([part["conditions"][k] for part in parts]) for k in parts[0]["conditions"]},
        states=torch.cat([part["states"] for part in parts]),
        log_probs=torch.cat([part["log_probs"] for part in parts]) if manifest.trajectories else None,
        sigmas=parts[0].get("sigmas"),
        rewards={k: torch.cat([part["rewards"][k] for part in parts]) for k in parts[0]["rewards"]},
    )


def write_records(path: Path, step: int, rollout: Rollout) -> None:
    """Append one line per sample: the step, its id, its prompt and its rewards."""
    with path.open("a") as file:
        for row, prompt in enumerate(rollout.prompts):
            rewards = {name: float(scores[row]) for name, scores in rollout.rewards.items()}
            file.write(
                json.dumps(
                    {"step": step, "sample_id": int(rollout.sample_ids[row]), "prompt": prompt, "rewards": rewards}
                )
                + "\n"
            )


def write_rollouts(trainer: Any, out: Path, steps: int, trajectories: bool) -> list[str]:
    """Sample and score ``steps`` steps of ``trainer``'s config (its rollout and scoring stages, no update) into
    ``out``; returns the summary lines."""
    from tqdm.auto import tqdm

    from gyremedia.media_io import save_image_grid

    state = trainer.setup() if trainer.state.backbone is None else trainer.state
    acc, core = state.accelerator, state.config.core
    out = Path(out)
    means: dict[str, float] = {}
    for step in tqdm(range(steps), desc="rollout", dynamic_ncols=True, disable=not acc.is_main_process):
        sampled, futures, _ = trainer.sample_and_submit(step)
        metrics = state.plugins.hook.gyremedia_score_rollout(state=state, rollout=sampled, futures=futures, step=step)
        torch.save(rollout_tensors(sampled, trajectories), step_file(out, step, acc.process_index))
        write_records(
            out / (RECORDS if acc.num_processes == 1 else f"records_rank{acc.process_index}.jsonl"), step, sampled
        )
        if step == 0 and acc.is_main_process and sampled.media is not None and sampled.media.kind == "image":
            save_image_grid(sampled.media.data[:32].float().cpu(), sampled.prompts[:32], out / "samples.png")
        for name in sampled.rewards:
            means[name] = means.get(name, 0.0) + metrics[f"reward/{name}"] / steps
    manifest = Manifest(
        steps=steps,
        batch_size=core.rollout.batch_size,
        group_size=core.rollout.group_size,
        processes=acc.num_processes,
        rewards=[s.name for s in state.config.rewards],
        trajectories=trajectories,
        model_evaluations=steps * core.rollout.batch_size * core.rollout.num_steps,
    )
    acc.wait_for_everyone()
    if acc.is_main_process:
        (out / MANIFEST).write_text(json.dumps(manifest.__dict__, indent=1) + "\n")
    return [
        f"wrote {steps} steps of {manifest.batch_size} samples to {out} ({manifest.model_evaluations:,} model "
        f"evaluations); mean reward: " + ", ".join(f"{k} {v:.3f}" for k, v in means.items()),
        f"train on them: gyremedia train CONFIG data.offline={out}",
    ]
