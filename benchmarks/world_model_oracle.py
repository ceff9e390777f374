"""The supervised oracle beside RL on the world model: what training on the environment's own clips gains.

    python benchmarks/world_model_oracle.py [--lr 1e-4] [--steps 300] [--every 100] [--batch 32] [--base-steps 4 10 30]

Continues the shipped GridWalk world model's pretraining (`gyremedia_world.pretrain`'s rectified-flow loss on real
clips, batch 32, AdamW) and prints held-out action following and PSNR (256 clips of the 128 held-out episodes, 10
Euler steps, fixed noise) every ``--every`` steps. Every reward of the world-model quickstart approximates the
environment's own frames, so this is the gain supervision by the truth buys from as many clips as an RL run sees
(100 steps x 32 clips): docs/benchmarks.md, "Why the gains stop at a few points". First it prints what the shipped
base gets wrong: the action following of each of a clip's 4 frames, sampled with each of ``--base-steps`` Euler steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from gyremedia.config import asset_path
from gyremedia.interfaces import BuildContext
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_world.backbone import VideoWorldBackbone, VideoWorldOptions
from gyremedia_world.pretrain import evaluate, flow_matching_step
from gyremedia_world.rewards import FidelityOptions, FidelityReward, InverseDynamicsOptions, InverseDynamicsReward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--base-steps", type=int, nargs="*", default=[4, 10, 30], help="sampling steps of the base probe"
    )
    args = parser.parse_args()
    print(f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}")
    backbone = VideoWorldBackbone(
        VideoWorldOptions(pretrained=asset_path("world16")), BuildContext(device=torch.device("cpu"))
    )
    rewards = {
        "inverse_dynamics": InverseDynamicsReward(InverseDynamicsOptions()),
        "fidelity": FidelityReward(FidelityOptions()),
    }
    heldout = [line for line in open(asset_path("world16/heldout_prompts.txt")).read().splitlines() if line] * 2
    optimizer = torch.optim.AdamW(backbone.transformer.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng, generator = np.random.default_rng([args.seed, 15]), torch.Generator().manual_seed(args.seed)

    def report(step: int, loss: float | None, started: float) -> None:
        scores = evaluate(backbone, rewards, heldout, seed=0)
        row = {"step": step, "seconds": round(time.time() - started), "loss": loss}
        row.update(action_following=scores["inverse_dynamics/accuracy"], psnr=scores["fidelity/psnr"])
        print(json.dumps(row), flush=True)

    for num_steps in args.base_steps:
        generated = backbone.generate(
            heldout, seed=0, sampler=EulerODESampler(), num_steps=num_steps, guidance_scale=1.0
        )
        frames = rewards["inverse_dynamics"](generated.media, heldout)["frames"].mean(dim=0)
        print(json.dumps({"base_sampling_steps": num_steps, "action_following_per_frame": frames.tolist()}), flush=True)
    started = time.time()
    report(0, None, started)
    backbone.transformer.train()
    for step in range(1, args.steps + 1):
        loss = flow_matching_step(backbone, optimizer, rng, generator, args.batch)
        if step % args.every == 0:
            report(step, loss, started)


if __name__ == "__main__":
    main()
