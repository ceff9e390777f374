"""Does the velocity-norm hinge hold the norm inflation down without costing reward? Measured in one run.

    python benchmarks/regularizers.py [--seeds 0 1 2] [--steps 100] [--weights 0.03 0.1]

Trains the quickstart (DiffusionNFT on the tiny ShapesBench model) per seed from the same base:
with ``velocity_norm_hinge`` at weight 0 (it only measures) and at each of ``--weights``. The proxy reward is
the verifier with the object, colour and count criteria only; the held-out gold reward is the
criterion it never sees (position, on the relation prompts), scored on the eval prompts by the
reward-hacking monitor, which also measures the velocity drift from the base model. Prints, per
setting (mean over seeds): the inflation |v| / |v_ref| over the last quarter of training (overall
and per noise-level bucket), the proxy reward reached (training, last quarter; and on the eval
prompts), the gold reward and the drift at the end, and each hinged setting relative to no hinge.
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
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart_nft.yaml"
COMMON = [
    "rewards=[{name: shapes_verifier, criteria: [object, colour, count]}]",
    "monitor={gold: [{name: shapes_verifier, criteria: [position]}], drift: true}",
    "export.on_train_end=false",
    "logging.progress=false",
]
INFLATION = "velocity_norm_hinge/inflation"


def run(weight: float, seed: int, steps: int, out: Path) -> list[dict]:
    pm = PluginManager()
    overrides = [
        f"run.output_dir={out}",
        f"run.seed={seed}",
        f"train.steps={steps}",
        f"checkpoint.every={steps}",
        f"regularizers=[{{name: velocity_norm_hinge, weight: {weight}}}]",
        *COMMON,
    ]
    Trainer(resolve_config(load_config(QUICKSTART, overrides), pm), pm).train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict], steps: int) -> dict[str, float]:
    """Means over the last quarter of training, and the final evaluation."""
    late = [r for r in rows if "reward" in r and r["step"] > steps * 3 // 4]
    final = [r for r in rows if "eval/gold/shapes_verifier" in r][-1]
    buckets = sorted(k for k in late[0] if k.startswith(INFLATION + "_t"))
    return {
        "inflation": sum(r[INFLATION] for r in late) / len(late),
        **{k.split("_t")[-1]: sum(r[k] for r in late if k in r) / sum(k in r for r in late) for k in buckets},
        "train_proxy": sum(r["reward"] for r in late) / len(late),
        "eval_proxy": final["eval/shapes_verifier"],
        "gold": final["eval/gold/shapes_verifier"],
        "drift": final["eval/drift"],
        "diversity": final["eval/diversity"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.03, 0.1], help="the hinge's weights to compare")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/regularizers.json"))
    args = parser.parse_args()
    weights = [0.0, *args.weights]
    results: dict[str, list[dict]] = {("no hinge" if w == 0 else f"hinge {w:g}"): [] for w in weights}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for label, weight in zip(results, weights):
                rows = run(weight, seed, args.steps, Path(tmp) / f"{weight}-{seed}")
                results[label].append(summarise(rows, args.steps))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))

    means = {label: {k: sum(s[k] for s in runs) / len(runs) for k in runs[0]} for label, runs in results.items()}
    print(
        f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)"
    )
    print(
        f"quickstart world (NFT), seeds {args.seeds}, {args.steps} steps; proxy = verifier object/colour/count, "
        "gold = verifier position (held out); means over seeds"
    )
    keys = list(next(iter(means.values())))
    print("| setting | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, row in means.items():
        print(f"| {label} | " + " | ".join(f"{row[k]:.4f}" for k in keys) + " |")
    plain = means["no hinge"]
    for label, hinged in list(means.items())[1:]:
        print(
            f"{label} vs none: inflation - 1: {plain['inflation'] - 1:+.4f} -> {hinged['inflation'] - 1:+.4f}; "
            f"training proxy {hinged['train_proxy'] - plain['train_proxy']:+.4f}, eval proxy "
            f"{hinged['eval_proxy'] - plain['eval_proxy']:+.4f}, gold {hinged['gold'] - plain['gold']:+.4f}"
        )
    for label, runs in results.items():
        print(
            f"  {label} per seed: "
            + "; ".join(
                f"inflation {s['inflation']:.4f} proxy {s['eval_proxy']:.3f} gold {s['gold']:.3f}" for s in runs
            )
        )


if __name__ == "__main__":
    main()
