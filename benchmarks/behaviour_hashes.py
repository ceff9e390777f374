"""Hashes of what every offline config does in a few steps: the per-step metrics and the final weights.

A change that claims "no behaviour change" (a refactor of the core) prints this table before and after and
compares: every row must match. Timings (``time/*``) are left out of the metrics; everything else a run logs,
and every tensor of its last checkpoint, is hashed. Configs that need weights or data this machine does not
have (the recipes at scale) are listed as skipped.

    python benchmarks/behaviour_hashes.py [--steps 2] [--only quickstart,llm_quickstart] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
#: What keeps a few steps short without changing what a step does: no evaluation between the first and the last.
SHORT = {"eval.every": "0"}


#: Features no bundled config turns on, each run on a quickstart: name -> (config, overrides).
VARIANTS = {
    "quickstart+candidates": ("quickstart_grpo", ["rollout.candidates=16", "rollout.candidate_steps=2"]),
    "quickstart_grpo+reuse": ("quickstart_grpo", ["train.reuse_rollout_forward=true", "train.num_minibatches=2"]),
    "quickstart+history": ("quickstart", ["advantage.history=4", "advantage.min_count=2"]),
    "quickstart+drift": ("quickstart_grpo", ["monitor.drift=true", "eval.every=1"]),
}


def offline_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.yaml")) + list(VARIANTS)


def metrics_hash(run_dir: Path) -> str:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        rows.append(json.dumps(row, sort_keys=True))
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def weights_hash(run_dir: Path) -> str:
    import torch
    from safetensors.torch import load_file

    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    digest = hashlib.sha256()
    for file in sorted(checkpoints[-1].rglob("*.safetensors")):
        for name, tensor in sorted(load_file(str(file)).items()):
            digest.update(f"{file.relative_to(checkpoints[-1])}:{name}".encode())
            digest.update(tensor.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def run(config: str, steps: int, folder: Path) -> dict[str, str]:
    run_dir = folder / config
    source, extra = VARIANTS.get(config, (config, []))
    overrides = [
        f"train.steps={steps}",
        f"run.output_dir={run_dir}",
        "export.on_train_end=false",
        "logging.progress=false",
        *(f"{k}={v}" for k, v in SHORT.items()),
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", "train", source, *overrides],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
    )
    seconds = f"{time.perf_counter() - started:.0f}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"config": config, "metrics": "skipped", "weights": "skipped", "seconds": seconds, "why": last[:160]}
    return {"config": config, "metrics": metrics_hash(run_dir), "weights": weights_hash(run_dir), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated config names (default: every config)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or offline_configs()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            rows.append(run(name, args.steps, Path(folder)))
            row = rows[-1]
            print(
                f"| {row['config']} | {row['metrics']} | {row['weights']} | {row['seconds']} s |"
                + (f" {row['why']}" if "why" in row else ""),
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
