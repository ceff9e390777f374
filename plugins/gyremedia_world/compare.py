"""Long autoregressive rollouts of a world-model run's base and trained models beside the truth.

    python -m gyremedia_world.compare runs/world_model_quickstart --clips 4

Each held-out episode's commanded actions are extended to ``--clips`` clips (the extra actions drawn
from the episode's seed); both models generate clip after clip, each from their own last frame.
Writes ``RUN_DIR/samples/autoregressive.gif`` (rows: truth, base, trained) and prints, per clip, the
share of actions the inverse dynamics model recovers and the PSNR and SSIM against the truth.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyremedia import evaluation
from gyremedia.config import asset_path
from gyremedia.media_io import save_video_grid
from gyremedia.plugins import PluginManager
from gyremedia.runtime import runs
from gyremedia_world.env import Episode, parse_prompt
from gyremedia_world.inverse_dynamics import InverseDynamicsModel
from gyremedia_world.rewards import psnr, ssim

GIF_EPISODES = 8


def extend(episode: Episode, clips: int, clip_frames: int) -> Episode:
    """The episode with its actions extended to ``clips`` clips by actions drawn from its seed."""
    return episode.extended(clips, clip_frames, np.random.default_rng([episode.episode, 16]))


def clip_scores(
    video: torch.Tensor, truth: torch.Tensor, episodes: list[Episode], clip_frames: int
) -> list[dict[str, float]]:
    """Per clip: inverse-dynamics accuracy of its actions (read from the model's own frames, the clip's
    context first), and PSNR and SSIM against the truth (which measure the drift too)."""
    inverse_dynamics = InverseDynamicsModel.load(asset_path("world16/inverse_dynamics"))
    context = torch.stack([torch.from_numpy(e.context()) for e in episodes])
    frames = torch.cat([context[:, None], video], dim=1)
    logits = inverse_dynamics(frames[:, :-1].flatten(0, 1), frames[:, 1:].flatten(0, 1)).view(*video.shape[:2], -1)
    right = logits.argmax(-1) == torch.tensor([e.actions for e in episodes])
    scores = []
    for begin in range(0, video.shape[1], clip_frames):
        clip, true_clip = (v[:, begin : begin + clip_frames].flatten(0, 1) for v in (video, truth))
        scores.append(
            {
                "id_accuracy": float(right[:, begin : begin + clip_frames].float().mean()),
                "psnr": float(psnr(clip, true_clip).mean()),
                "ssim": float(ssim(clip, true_clip).mean()),
            }
        )
    return scores


@torch.no_grad()
def own_rollouts(backbone: Any, sampler: Any, episodes: list[Episode], *, seed: int, num_steps: int) -> torch.Tensor:
    """The episodes' videos ``[B, K * T, 3, H, W]`` in [0, 1] as the model rolls them out from each start frame,
    clip after clip from its own last frame (fixed noise: ``seed`` and each episode's position)."""
    backbone.trainable_module().eval()
    context = torch.stack([backbone.frame(e.context()) for e in episodes])
    actions = torch.tensor([e.actions for e in episodes], device=backbone.device)
    ids = list(range(len(episodes)))
    return backbone.generate_clips(sampler, context, actions, seed=seed, ids=ids, num_steps=num_steps).cpu()


@torch.no_grad()
def compare(run_dir: Path, clips: int, episodes: int) -> dict:
    """Roll the base and trained models of ``run_dir`` out for ``clips`` clips on the first ``episodes``
    eval episodes; write the GIF and return the per-clip scores of each."""
    pm = PluginManager()
    config = runs.run_config(run_dir, [], pm)
    backbone = runs.build_backbone(config, pm)
    sampler, _ = runs.build_scoring(config, pm)
    chosen = [extend(parse_prompt(p), clips, backbone.clip_frames) for p in evaluation.eval_prompts(config)[:episodes]]
    num_steps = config.core.eval.num_steps or config.core.rollout.num_steps
    videos = {"base": own_rollouts(backbone, sampler, chosen, seed=config.core.eval.seed, num_steps=num_steps)}
    runs.load_trained_weights(backbone, run_dir)
    videos["trained"] = own_rollouts(backbone, sampler, chosen, seed=config.core.eval.seed, num_steps=num_steps)
    truth = torch.stack([torch.from_numpy(e.truth()) for e in chosen])
    path, shown = run_dir / "samples" / "autoregressive.gif", min(GIF_EPISODES, len(chosen))
    captions = [label for label in ("truth", "base", "trained") for _ in range(shown)]
    save_video_grid(
        torch.cat([truth[:shown], videos["base"][:shown], videos["trained"][:shown]]),
        captions,
        path,
        columns=shown,
        fps=backbone.options.fps,
        caption_lines=1,
    )
    report = {label: clip_scores(video, truth, chosen, backbone.clip_frames) for label, video in videos.items()}
    return {"episodes": len(chosen), "clips": clips, "gif": str(path), **report}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--clips", type=int, default=4, help="clips per rollout, each continuing from the last")
    parser.add_argument("--episodes", type=int, default=64, help=f"held-out episodes (the GIF shows {GIF_EPISODES})")
    args = parser.parse_args(argv)
    print(json.dumps(compare(args.run_dir, args.clips, args.episodes), indent=1))


if __name__ == "__main__":
    main()
