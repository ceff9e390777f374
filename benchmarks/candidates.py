"""Does a cheap candidate pool find the contrastive samples? Sol-RL's premise, measured on the quickstart world.

    python benchmarks/candidates.py [--config configs/quickstart_grpo.yaml] [--steps 2 3 5] [--pool 32]
                                    [--rollouts 2] [key=value ...]

Two-stage rollouts (``rollout.candidates``) pay only if a candidate's cheap sample (``--steps`` steps of the
eval sampler) ranks its initial noise the way the full-quality sample from the same noise would be ranked
(the run's sampler, ``rollout.num_steps`` steps). For ``--rollouts`` steps' prompts, ``--pool`` candidates per
prompt are sampled both ways and scored with the run's first reward; printed per candidate step count:

* the mean within-prompt Spearman correlation of cheap and full rewards;
* the mean within-prompt std of the full rewards of the ``group_size`` candidates the cheap ones choose
  (:func:`gyremedia_features.candidates.contrastive_subset`), against a random ``group_size`` of them and against the
  subset an oracle (the full rewards themselves) would choose: the spread of the advantages' signal;
* NFEs per prompt of the pool, against one stage's ``group_size x num_steps``.

Run on the full-quality sampler of the config (``sampler.name=...`` to change it).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.stages.rollout import rollout_request
from gyremedia.trainer import Trainer
from gyremedia_features.candidates import candidate_pool, contrastive_subset

QUICKSTART_GRPO = Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"


def pool_rewards(trainer: Trainer, step: int, num_steps: int, sampler) -> torch.Tensor:
    """``[groups, candidates]`` rewards of each step-``step`` prompt's candidates sampled ``num_steps`` steps
    with ``sampler`` (the candidates plugin's own pool, :func:`gyremedia_features.candidates.candidate_pool`)."""
    state = trainer.state
    pool = candidate_pool(rollout_request(state, step), num_steps)
    media = state.backbone.media(state.backbone.collect_rollout(pool, sampler))
    reward = trainer.config.rewards[0].name
    return state.rewards[reward](media, pool.prompts)["score"].double().reshape(-1, trainer.core.rollout.candidates)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ranks = [x.argsort().argsort().double() for x in (a, b)]
    return float(np.corrcoef(ranks[0].numpy(), ranks[1].numpy())[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=QUICKSTART_GRPO)
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 3, 5], help="denoising steps of a candidate")
    parser.add_argument("--pool", type=int, default=32, help="candidates per prompt")
    parser.add_argument("--rollouts", type=int, default=2, help="steps' prompts to measure on")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    pm = PluginManager()
    with tempfile.TemporaryDirectory() as tmp:
        config = resolve_config(
            load_config(args.config, [f"run.output_dir={tmp}", f"rollout.candidates={args.pool}", *args.overrides]), pm
        )
        trainer = Trainer(config, pm)
        state = trainer.setup()
        r = trainer.core.rollout
        full = torch.cat([pool_rewards(trainer, s, r.num_steps, state.sampler) for s in range(args.rollouts)])
        rng = torch.Generator().manual_seed(0)
        random = torch.stack([torch.randperm(args.pool, generator=rng)[: r.group_size] for _ in range(len(full))])
        oracle = full.gather(1, contrastive_subset(full, r.group_size)).std(dim=1).mean()
        print(
            f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
            f"{torch.__version__} ({torch.get_num_threads()} threads)"
        )
        print(
            f"{args.config.name} {' '.join(args.overrides)}: {len(full)} prompts x {args.pool} candidates; full quality "
            f"= {config.sampler.name if config.sampler else 'the policy'} x {r.num_steps} steps, cheap = "
            f"{config.eval_sampler.name if config.eval_sampler else 'the same'}; group_size {r.group_size}"
        )
        print(
            "| candidate steps | Spearman cheap vs full | std of the chosen group's full rewards | random group | "
            "oracle's choice | pool NFEs per prompt vs one stage |\n|---|---|---|---|---|---|"
        )
        for steps in args.steps:
            cheap = torch.cat(
                [pool_rewards(trainer, s, steps, trainer.state.eval_sampler) for s in range(args.rollouts)]
            )
            rho = np.nanmean([spearman(c, f) for c, f in zip(cheap, full) if c.std() > 0 and f.std() > 0])
            chosen = full.gather(1, contrastive_subset(cheap, r.group_size)).std(dim=1).mean()
            print(
                f"| {steps} | {rho:.2f} | {chosen:.3f} | {full.gather(1, random).std(dim=1).mean():.3f} | "
                f"{oracle:.3f} | {args.pool * steps} + {r.group_size * r.num_steps} vs {r.group_size * r.num_steps} |"
            )


if __name__ == "__main__":
    main()
