"""Make ``assets/world16``: the inverse dynamics model and the tiny GridWalk video world model (CPU, fixed seed).

    python -m gyremedia_world.pretrain --out assets/world16 --steps 1500

Stage 1 trains the inverse dynamics model on real transitions. Stage 2 trains the video world model
(a ``WanTransformer3DModel`` in pixel space) with the rectified-flow loss on real clips: a random start
state, four random actions, the four frames the environment renders. Timesteps are uniform. The model
is stopped early on purpose, so it follows actions imperfectly and RL has room.
``pretraining.json`` records the command and what was measured at the end: held-out action-following
accuracy (inverse dynamics on generated clips, Euler ODE with 10 steps, as the quickstart evaluates) and
fidelity, beside the inverse dynamics model's accuracy on the environment's own frames.
Deterministic for a given seed, step count and torch thread count.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gyremedia.evaluation import nanmean, score
from gyremedia.interfaces import BuildContext
from gyremedia.sampling import renoise
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_world.backbone import TinyWorldOptions, VideoWorldBackbone, VideoWorldOptions
from gyremedia_world.env import HELDOUT_SEED_OFFSET, random_episodes
from gyremedia_world.inverse_dynamics import accuracy_on_real, train_inverse_dynamics
from gyremedia_world.rewards import FidelityOptions, FidelityReward, InverseDynamicsOptions, InverseDynamicsReward

TRAIN_EPISODES, HELDOUT_EPISODES = 2048, 128


def write_prompt_files(out: Path) -> tuple[list[str], list[str]]:
    """The RL prompts: training episodes 0.. and held-out episodes (unseen seeds and action sequences)."""
    train = [e.text for e in random_episodes(TRAIN_EPISODES, seed=1)]
    heldout = [e.text for e in random_episodes(HELDOUT_EPISODES, seed=2, first_episode=HELDOUT_SEED_OFFSET)]
    (out / "train_prompts.txt").write_text("\n".join(train) + "\n")
    (out / "heldout_prompts.txt").write_text("\n".join(heldout) + "\n")
    return train, heldout


def evaluate(backbone: VideoWorldBackbone, rewards: dict, prompts: list[str], seed: int = 1234) -> dict[str, float]:
    """Mean reward components of one clip per prompt, generated with 10 Euler steps."""
    backbone.transformer.eval()
    media = backbone.generate(prompts, seed=seed, sampler=EulerODESampler(), num_steps=10, guidance_scale=1.0).media
    backbone.transformer.train()
    return {k: nanmean(v) for k, v in score(rewards, media, prompts).items()}


def flow_matching_step(
    backbone: VideoWorldBackbone,
    optimizer: torch.optim.Optimizer,
    rng: np.random.Generator,
    generator: torch.Generator,
    batch: int,
) -> float:
    """One optimizer step of the rectified-flow loss on ``batch`` of the environment's own clips (random training
    episodes drawn from ``rng``, levels and noise from ``generator``); returns the loss."""
    episodes = random_episodes(
        batch, seed=int(rng.integers(2**31)), first_episode=int(rng.integers(HELDOUT_SEED_OFFSET - batch))
    )
    conditions = backbone.encode([e.text for e in episodes])
    x0 = (torch.stack([torch.from_numpy(e.truth()) for e in episodes]) * 2 - 1).permute(0, 2, 1, 3, 4)
    t = torch.rand(batch, generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    loss = torch.nn.functional.mse_loss(backbone.predict(renoise(x0, noise, t), t, conditions), noise - x0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(backbone.transformer.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def pretrain(
    out: Path, steps: int, id_steps: int, seed: int, batch: int, lr: float, eval_every: int, snapshots: Path | None
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    inverse_dynamics, id_loss = train_inverse_dynamics(id_steps, seed)
    inverse_dynamics.save(out / "inverse_dynamics")
    id_real = accuracy_on_real(inverse_dynamics, 2048, seed)
    id_minutes = (time.time() - started) / 60
    print(
        json.dumps({"inverse_dynamics": {"loss": id_loss, "real_accuracy": id_real, "minutes": id_minutes}}), flush=True
    )

    train_prompts, heldout_prompts = write_prompt_files(out)
    rewards = {
        "inverse_dynamics": InverseDynamicsReward(InverseDynamicsOptions(model=str(out / "inverse_dynamics"))),
        "fidelity": FidelityReward(FidelityOptions()),
    }
    backbone = VideoWorldBackbone(
        VideoWorldOptions(tiny=TinyWorldOptions(seed=seed)), BuildContext(device=torch.device("cpu"))
    )
    model = backbone.transformer.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = np.random.default_rng([seed, 15])
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in tqdm(range(1, steps + 1), desc="world model", mininterval=10):
        loss = flow_matching_step(backbone, optimizer, rng, generator, batch)
        if step % eval_every == 0 or step == steps:
            record = {
                "step": step,
                "minutes": (time.time() - started) / 60,
                "loss": loss,
                "heldout": evaluate(backbone, rewards, heldout_prompts),
                "train": evaluate(backbone, rewards, train_prompts[: len(heldout_prompts)]),
            }
            history.append(record)
            print(json.dumps(record), flush=True)
            if snapshots is not None:
                backbone.save_pretrained(snapshots / f"step-{step:06d}")
    backbone.save_pretrained(out)
    summary = {
        "command": f"python -m gyremedia_world.pretrain --out {out} --steps {steps} --id-steps {id_steps} --seed {seed} "
        f"--batch {batch} --lr {lr}",
        "seed": seed,
        "steps": steps,
        "minutes": (time.time() - started) / 60,
        "torch_threads": torch.get_num_threads(),
        "inverse_dynamics": {"steps": id_steps, "loss": id_loss, "real_accuracy": id_real, "minutes": id_minutes},
        "parameters": sum(p.numel() for p in model.parameters()),
        "final": history[-1],
        "history": history,
        "train_prompts": len(train_prompts),
        "heldout_prompts": len(heldout_prompts),
    }
    (out / "pretraining.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, required=True, help="folder to write (the world model and the inverse dynamics model)"
    )
    parser.add_argument("--steps", type=int, default=1500, help="world-model training steps")
    parser.add_argument("--id-steps", type=int, default=1500, help="inverse-dynamics training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--snapshots", type=Path, default=None, help="also save the model at every evaluation")
    args = parser.parse_args(argv)
    summary = pretrain(
        args.out, args.steps, args.id_steps, args.seed, args.batch, args.lr, args.eval_every, args.snapshots
    )
    print(json.dumps(summary["final"], indent=2))


if __name__ == "__main__":
    main()
