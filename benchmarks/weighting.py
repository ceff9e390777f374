"""Which timestep weighting of the ELBO surrogate trains AWM fastest on the quickstart world?

    python benchmarks/weighting.py [--seeds 0] [--steps 100] [--weightings uniform t t2 ghuber budgeted dynamic]

Trains AWM (configs/quickstart_nft.yaml with ``objective={name: awm}``) once per (weighting, seed) from
the same base, the weighting selected by the ``weighting:`` section only. Prints held-out accuracy
(256 fixed-seed samples) every 25 steps, the mean over seeds, each run's ratio to ``uniform``'s final
gain measured in the same run, and what the adaptive ones chose (budgeted: the profile kept;
dynamic: the final power).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from gyremedia.config import load_config, resolve_config
from gyremedia.objectives.weighting import BudgetedOptions
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart_nft.yaml"
ACCURACY = "eval/shapes_verifier/correct"


def run(weighting: str, seed: int, steps: int, out: Path) -> list[dict]:
    pm = PluginManager()
    overrides = [
        f"run.output_dir={out}",
        f"run.seed={seed}",
        f"train.steps={steps}",
        f"checkpoint.every={steps}",
        "objective={name: awm}",
        f"weighting={weighting}",
        "export.on_train_end=false",
        "logging.progress=false",
    ]
    Trainer(resolve_config(load_config(QUICKSTART, overrides), pm), pm).train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--weightings", nargs="+", default=["uniform", "t", "t2", "ghuber", "budgeted", "dynamic"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weighting.json"))
    args = parser.parse_args()
    curves: dict[str, list[list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for weighting in args.weightings:
            curves[weighting] = [
                run(weighting, seed, args.steps, Path(tmp) / f"{weighting}-{seed}") for seed in args.seeds
            ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(curves))

    print(
        f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
    )
    print(
        f"AWM on the quickstart world, seeds {args.seeds}, {args.steps} steps; held-out accuracy (%), mean over seeds"
    )
    evals = [r["step"] for r in curves[args.weightings[0]][0] if ACCURACY in r]
    print("| weighting | " + " | ".join(f"step {s}" for s in evals) + " | gain vs first row | chose |")
    print("|---" * (len(evals) + 3) + "|")
    reference = None
    for weighting, runs in curves.items():
        means = [
            100
            * sum(next(r[ACCURACY] for r in rows if r.get("step") == s and ACCURACY in r) for rows in runs)
            / len(runs)
            for s in evals
        ]
        gain = means[-1] - means[0]
        reference = gain if reference is None else reference
        last = [rows[-1] for rows in runs]
        profiles = BudgetedOptions().profiles
        chose = (
            "kept " + ", ".join(profiles[int(r["weighting/profile"])] for r in last)
            if weighting == "budgeted"
            else "power " + ", ".join(f"{r['weighting/power']:.2f}" for r in last)
            if weighting == "dynamic"
            else ""
        )
        ratio = f"{gain / reference:.2f}x" if reference else "n/a (the first row gained nothing)"
        print(f"| {weighting} | " + " | ".join(f"{m:.1f}" for m in means) + f" | {ratio} | {chose} |")


if __name__ == "__main__":
    main()
