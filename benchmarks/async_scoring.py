"""Step time with a slow reward, scored serially vs overlapped with the next rollout's sampling.

    python benchmarks/async_scoring.py [--steps 6] [--delay 1.0]

Trains the quickstart model (configs/quickstart_nft.yaml, DiffusionNFT) with its verifier reward wrapped to take
``--delay`` extra seconds per call, as a remote judge would, once with ``rollout.async_scoring=false``
and once with ``true``, and prints the mean step time (sampling + scoring + update; the first step,
which has nothing to overlap with, excluded) and their ratio. Both runs are measured here, now.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from gyremedia import hookimpl
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart_nft.yaml"


class SlowPlugin:
    """Registers ``slow_verifier``: the shapes verifier plus a fixed delay per call."""

    delay = 1.0

    @staticmethod
    @hookimpl
    def gyremedia_register_rewards(register):
        from gyremedia_shapes.verifier_reward import ShapesVerifierOptions, ShapesVerifierReward

        class SlowVerifier(ShapesVerifierReward):
            def __call__(self, media, prompts):
                time.sleep(SlowPlugin.delay)
                return super().__call__(media, prompts)

        register("slow_verifier", SlowVerifier, options=ShapesVerifierOptions, kinds={"image"})


def mean_step_seconds(async_scoring: bool, steps: int, out: Path) -> float:
    pm = PluginManager(extra_plugins=[SlowPlugin])
    overrides = [
        f"run.output_dir={out}",
        f"train.steps={steps}",
        "rewards.0.name=slow_verifier",
        f"rollout.async_scoring={str(async_scoring).lower()}",
        "eval.prompts_file=null",
        "eval.samples=8",
        "eval.every=0",
        "eval.metric=null",
        "export.on_train_end=false",
        f"checkpoint.every={steps}",
        "logging.progress=false",
    ]
    Trainer(resolve_config(load_config(QUICKSTART, overrides), pm), pm).train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/rollout"] + r["time/reward"] + r["time/train"] for r in rows if "time/train" in r]
    return sum(times[1:]) / len(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds the reward waits per call")
    args = parser.parse_args()
    SlowPlugin.delay = args.delay
    with tempfile.TemporaryDirectory() as tmp:
        serial = mean_step_seconds(False, args.steps, Path(tmp) / "serial")
        overlapped = mean_step_seconds(True, args.steps, Path(tmp) / "async")
    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), no accelerator"
        if not torch.accelerator.is_available()
        else f"hardware: {torch.accelerator.current_accelerator()}"
    )
    print(f"quickstart model, batch 32, reward delay {args.delay:.1f} s per call, {args.steps - 1} steps each")
    print(
        f"| scoring | mean step time | speed-up vs serial |\n|---|---|---|\n| serial | {serial:.2f} s | 1.00x |\n"
        f"| async (overlapped) | {overlapped:.2f} s | {serial / overlapped:.2f}x |"
    )


if __name__ == "__main__":
    main()
