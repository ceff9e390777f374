"""RL on the GridWalk video world model: held-out action following and fidelity, per seed, in one run.

    python benchmarks/world_model.py [--seeds 0 1 2] [--config world_model_quickstart] [--gif PATH] [key=value ...]

Trains the config once per seed from the shipped world model, and prints for each seed the run's own fixed-seed
evaluations (256 clips of unseen episodes) before and after: inverse-dynamics accuracy (action following) and
fidelity (SSIM, PSNR against the true frames); then, for 4-clip autoregressive rollouts of the same episodes (each
clip from the model's own last frame), the accuracy, PSNR and SSIM of each clip, base vs trained, and their mean
over the seeds. ``--gif`` keeps the first seed's rollouts (truth, base, trained). Extra ``key=value`` arguments
override the config (e.g. ``backbone.rollout_clips=4``: train on the model's own rollouts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gyremedia.cli import bundled_config
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer
from gyremedia_world.compare import compare

ACCURACY, SSIM, PSNR = "eval/inverse_dynamics/accuracy", "eval/world_fidelity/ssim", "eval/world_fidelity/psnr"
CLIPS = 4  # clips of the autoregressive rollouts


def run(config: str, seed: int, overrides: list[str], out: Path) -> dict:
    pm = PluginManager()
    resolved = resolve_config(
        load_config(
            bundled_config(config + ".yaml"),
            [f"run.output_dir={out}", f"run.seed={seed}", "logging.progress=false", *overrides],
        ),
        pm,
    )
    start = time.perf_counter()
    Trainer(resolved, pm).train()
    minutes = (time.perf_counter() - start) / 60
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if ACCURACY in r]
    return {
        "seed": seed,
        "minutes": minutes,
        "accuracy": [evals[0][ACCURACY], evals[-1][ACCURACY]],
        "ssim": [evals[0].get(SSIM), evals[-1].get(SSIM)],
        "psnr": [evals[0].get(PSNR), evals[-1].get(PSNR)],
        "autoregressive": compare(out, clips=CLIPS, episodes=128),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default="world_model_quickstart")
    parser.add_argument("--gif", type=Path, help="copy the first seed's autoregressive GIF (truth, base, trained) here")
    args, overrides = parser.parse_known_args()
    print(f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            result = run(args.config, seed, overrides, Path(tmp) / f"seed{seed}")
            results.append(result)
            if args.gif and len(results) == 1:
                shutil.copyfile(result["autoregressive"]["gif"], args.gif)
            print(json.dumps(result), flush=True)
    print(
        f"\n{'seed':<6}{'accuracy base':>14}{'trained':>9}{'gain':>7}{'PSNR base':>11}{'trained':>9}"
        f"{'SSIM base':>11}{'trained':>9}{'minutes':>9}"
    )
    for r in results:
        a, p, s = r["accuracy"], r["psnr"], r["ssim"]
        print(
            f"{r['seed']:<6}{a[0]:>14.3f}{a[1]:>9.3f}{100 * (a[1] - a[0]):>+7.1f}{p[0]:>11.2f}{p[1]:>9.2f}"
            f"{s[0]:>11.3f}{s[1]:>9.3f}{r['minutes']:>9.1f}"
        )
    print(f"\nautoregressive ({CLIPS} clips, 128 held-out episodes): accuracy / PSNR / SSIM per clip")
    for r in results:
        for label in ("base", "trained"):
            print(f"seed {r['seed']} {label:<8}" + "  ".join(clip_text(c) for c in r["autoregressive"][label]))
    for label in ("base", "trained"):
        clips = [r["autoregressive"][label] for r in results]
        means = [{k: sum(c[i][k] for c in clips) / len(clips) for k in clips[0][0]} for i in range(CLIPS)]
        print(f"mean {label:<10}" + "  ".join(clip_text(c) for c in means))


def clip_text(clip: dict[str, float]) -> str:
    return f"{clip['id_accuracy']:.3f} / {clip['psnr']:.1f} / {clip['ssim']:.3f}"


if __name__ == "__main__":
    main()
