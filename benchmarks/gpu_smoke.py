"""A first GPU run through the core: 10 Flow-GRPO quickstart steps in fp32 and in bf16 on one CUDA device.

    python benchmarks/gpu_smoke.py [--steps 10]

Prints one JSON line: per precision, the first on-policy update's mean importance ratio (exactly 1.0
when replay reproduces the rollout) and approximate KL (exactly 0), steps per second (rollout, reward
and update, over the steps after the first, which pays for warm-up), and peak GPU memory. Also the device, torch and CUDA
versions. Takes about a minute on a current GPU; it refuses to run without CUDA, since on a CPU it
would measure nothing this script is for (tests/test_device_placement.py covers device placement there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from gyremedia.cli import bundled_config
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}


def run(precision: str, steps: int, root: Path) -> dict[str, float]:
    """Train the quickstart's Flow-GRPO recipe for ``steps`` steps at ``precision``; its figures."""
    pm = PluginManager()
    overrides = [f"run.output_dir={root / precision}", f"train.steps={steps}", f"backbone.dtype={PRECISIONS[precision]}",
                 "eval.prompts_file=null", "eval.samples=16", "checkpoint.every=1000", "export.on_train_end=false",
                 "logging.progress=false"]
    config = resolve_config(load_config(bundled_config("quickstart_grpo.yaml"), overrides), pm)
    torch.cuda.reset_peak_memory_stats()
    Trainer(config, pm).train()
    torch.cuda.synchronize()
    lines = [json.loads(line) for line in (root / precision / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [m for m in lines if "time/train" in m]
    later = steps_seen[1:] or steps_seen  # the first step pays for warm-up
    seconds = [m["time/rollout"] + m["time/reward"] + m["time/train"] for m in later]
    return {"ratio_first_step": steps_seen[0]["ratio"], "approx_kl_first_step": steps_seen[0]["approx_kl"],
            "steps_per_s": len(seconds) / sum(seconds), "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: this smoke test measures a GPU run"}))
        return 1
    with tempfile.TemporaryDirectory() as folder:
        figures = {name: run(name, args.steps, Path(folder)) for name in PRECISIONS}
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "steps": args.steps, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
