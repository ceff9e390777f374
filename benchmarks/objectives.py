"""Which objective learns the quickstart world fastest? NFEs and wall time to a target, per objective.

    python benchmarks/objectives.py [--seeds 0 1 2] [--jobs 2] [--eval-every 25] [--gain 10] [--objectives ...]

Runs each objective's config (OBJECTIVES: Flow-GRPO's recipe, configs/quickstart_grpo.yaml, is the
baseline; the same at its previous learning rate, 2e-4, and full-SDE GRPO, MixGRPO's window and TreeGRPO's
trees on that; DiffusionNFT, Sol-RL's two-stage rollouts on it, and AWM on configs/quickstart.yaml) once per
seed from the same base model, counting every transformer forward row (NFEs: sampling, training,
old-policy and reference passes; evaluation excluded) and the wall time of the training steps (evaluation
excluded). Held-out accuracy is measured every ``--eval-every`` steps on the quickstart's 256 fixed-seed
samples. Prints, per objective (mean over seeds): NFEs and seconds to reach base + ``--gain`` points,
accuracy at the largest NFE budget every run covers, and ratios against the baseline measured in the same
run. A baseline seed that never reaches the target counts with its whole run, which makes a ratio a lower
bound (printed as ">="). Reaching the target is also read off the seeds' mean curve (each seed's accuracy
linear in NFEs between evaluations, averaged, then the first NFE count at the target): steadier than the
mean of each seed's first evaluation at the target, which one seed's early or late crossing moves.
Writes the curves to ``--out`` (JSON) and a plot beside it.

    python benchmarks/objectives.py --report A.json B.json ...

prints the same table for the curves of earlier runs, merged per objective (a run that is in two files, the
same seed run twice, counts once): the baseline is the first objective of the first file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FLOW_GRPO = CONFIGS / "quickstart_grpo.yaml"
#: The recipe's learning rate before it became 1.5e-4: the MixGRPO, full-SDE and tree rows of docs/benchmarks.md
#: were measured on it, so their entries keep it.
LR_2E4 = "train.learning_rate=2.0e-4"
#: Flow-GRPO's objective settings, trained on tree rollouts: every tree node once (dedup), per-depth normalisation.
TREE_GRPO = (
    "objective={name: tree_grpo, clip_range: 1.0e-4, transition_selection: first, timestep_fraction: 0.3, "
    "skip_zero_advantage: true, dedup: true, normalize_depth: true}"
)
#: Two trees per group, each from its own initial noise, splitting in 2 at transitions 0 and 1 (8 leaves).
TWO_ROOTS = ("rollout.branch_steps=[0, 1]", "rollout.branch_width=2", "rollout.branch_roots=2")
#: objective name -> (config, overrides, default steps); the baseline first: Flow-GRPO's recipe as its code trains it.
OBJECTIVES = {
    "flow_grpo": (FLOW_GRPO, [], 150),
    "flow_grpo_lr2e-4": (FLOW_GRPO, [LR_2E4], 150),
    # Full-SDE GRPO, MixGRPO's own baseline: the recipe with every stochastic transition of the 10 trained.
    "flow_grpo_full_sde": (FLOW_GRPO, [LR_2E4, "objective.timestep_fraction=1.0"], 150),
    # The recipe training only its first 2 transitions: the flat control for trees that skip their third.
    "flow_grpo_first2": (FLOW_GRPO, [LR_2E4, "objective.timestep_fraction=0.2"], 150),
    # MixGRPO: SDE only inside a 3-step window that moves one index every 25 steps, ODE elsewhere;
    # every stochastic transition (the window's) is trained.
    "mixgrpo": (
        FLOW_GRPO,
        [
            LR_2E4,
            "sampler={name: window, noise_level: 0.7, size: 3, schedule: progressive, shift_every: 25}",
            "objective.timestep_fraction=1.0",
        ],
        150,
    ),
    # TreeGRPO on Flow-GRPO's recipe: the 3 trained transitions are the branch points (8 leaves per tree),
    # each tree node trained once (dedup), advantages normalised per tree and depth.
    "tree_grpo": (FLOW_GRPO, [LR_2E4, TREE_GRPO, "rollout.branch_steps=[0, 1, 2]", "rollout.branch_width=2"], 150),
    # The same with two trees per group (each from its own initial noise) splitting at the first 2 transitions:
    # more diverse groups for fewer shared steps.
    "tree_grpo_roots": (FLOW_GRPO, [LR_2E4, TREE_GRPO, *TWO_ROOTS], 150),
    # The same, width-pruned: per group and depth only the 4 nodes of largest |advantage| are trained
    # (12 of each group's 20 nodes), so training replays fewer rows.
    "tree_grpo_pruned": (FLOW_GRPO, [LR_2E4, TREE_GRPO, *TWO_ROOTS, "objective.width=4"], 150),
    # The same, depth-pruned: transition 2 (8 of the 20 nodes each group trains) is never trained.
    "tree_grpo_skip_leaves": (FLOW_GRPO, [LR_2E4, TREE_GRPO, *TWO_ROOTS, "objective.skip_steps=[2]"], 150),
    # Two trees per group splitting at transitions 1 and 2: transition 0 is shared by each tree's 4 leaves, so a
    # group samples and trains fewer rows (14 nodes trained, against 20 splitting at 0 and 1).
    "tree_grpo_later_splits": (
        FLOW_GRPO,
        [LR_2E4, TREE_GRPO, "rollout.branch_steps=[1, 2]", "rollout.branch_width=2", "rollout.branch_roots=2"],
        150,
    ),
    "nft": (CONFIGS / "quickstart.yaml", [], 100),
    # Sol-RL's two-stage rollouts on DiffusionNFT: per prompt 16 initial noises sampled with 5 ODE steps and
    # scored; the 4 best and 4 worst are sampled again at full quality and trained on.
    "nft_two_stage": (CONFIGS / "quickstart.yaml", ["rollout.candidates=16", "rollout.candidate_steps=5"], 100),
    "awm": (
        CONFIGS / "quickstart.yaml",
        ["objective={name: awm}", "sampler={name: ode}", "train.learning_rate=1e-4"],
        100,
    ),
}
ACCURACY = "eval/shapes_verifier/correct"


class CountingTrainer(Trainer):
    """Counts transformer forward rows outside evaluation, and times the training steps."""

    def setup(self):
        state = super().setup()
        self.nfe, self.counting, self.seconds = 0, True, 0.0
        self.curve: list[dict] = []

        def count(module, args, kwargs):
            if self.counting:
                self.nfe += kwargs["hidden_states"].shape[0]

        # the frozen reference of a full fine-tune (KL terms) is a copy made at setup: it is counted too
        for module in (state.backbone.trainable_module(), getattr(state.backbone, "_reference_transformer", None)):
            if module is not None:
                module.register_forward_pre_hook(count, with_kwargs=True)
        return state

    def train_step(self, step):
        start = time.perf_counter()
        metrics = super().train_step(step)
        self.seconds += time.perf_counter() - start
        return metrics

    def evaluate(self, step):
        self.counting = False
        try:
            metrics = super().evaluate(step)
        finally:
            self.counting = True
        self.curve.append(
            {
                "step": step,
                "nfe": self.nfe,
                "seconds": self.seconds,
                "accuracy": metrics[ACCURACY],
                "diversity": metrics.get("eval/diversity"),
            }
        )
        return metrics


def run(objective: str, seed: int, steps: int | None, eval_every: int, out: Path) -> list[dict]:
    """One training run's evaluation curve (one torch thread, so parallel runs do not share cores)."""
    torch.set_num_threads(1)
    config, objective_overrides, default_steps = OBJECTIVES[objective]
    steps = steps or default_steps
    pm = PluginManager()
    overrides = [
        f"run.output_dir={out}",
        f"run.seed={seed}",
        f"train.steps={steps}",
        f"eval.every={eval_every}",
        "export.on_train_end=false",
        f"checkpoint.every={steps}",
        "logging.progress=false",
        *objective_overrides,
    ]
    trainer = CountingTrainer(resolve_config(load_config(config, overrides), pm), pm)
    trainer.train()
    return trainer.curve


def first_reaching(curve: list[dict], target: float, key: str) -> float | None:
    """``key`` (nfe or seconds) at the first evaluation at or above ``target`` (None: never)."""
    return next((point[key] for point in curve if point["accuracy"] >= target), None)


def accuracy_at(curve: list[dict], budget: float) -> float:
    """Held-out accuracy of the last evaluation within an NFE budget."""
    return [p["accuracy"] for p in curve if p["nfe"] <= budget][-1]


def mean(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(values) / len(values)


def mean_curve_reaching(runs: list[list[dict]], target: float, points: int = 2001) -> float | None:
    """NFEs at which the seeds' mean accuracy first reaches ``target`` (None: never within every run's NFEs)."""
    grid = np.linspace(0, min(c[-1]["nfe"] for c in runs), points)
    mean_accuracy = np.mean([np.interp(grid, [p["nfe"] for p in c], [p["accuracy"] for p in c]) for c in runs], axis=0)
    reached = np.flatnonzero(mean_accuracy >= target)
    return float(grid[reached[0]]) if len(reached) else None


def merged_curves(paths: list[Path]) -> dict[str, list[list[dict]]]:
    """The curves of earlier runs' JSON files per objective, in file order; a curve already seen (the same
    evaluations, as when one seed was run twice) is kept once."""
    curves: dict[str, list[list[dict]]] = {}
    seen: set[tuple] = set()
    for path in paths:
        for objective, runs in json.loads(path.read_text())["curves"].items():
            for run in runs:
                key = (objective, *((p["step"], p["nfe"], p["accuracy"]) for p in run))
                if key not in seen:
                    seen.add(key)
                    curves.setdefault(objective, []).append(run)
    return curves


def cost_to_target(runs: list[list[dict]], target: float, key: str) -> tuple[float, bool]:
    """Mean ``key`` to the target over seeds, a seed that never reached it counting with its whole run;
    and whether every seed reached it (else the mean is a lower bound)."""
    costs = [first_reaching(c, target, key) for c in runs]
    whole = [c[-1][key] for c in runs]
    return sum(w if c is None else c for c, w in zip(costs, whole)) / len(runs), all(c is not None for c in costs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default: each objective's own)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process and one torch thread each")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--gain", type=float, default=10.0, help="target: base accuracy + this many points")
    parser.add_argument(
        "--objectives",
        nargs="+",
        default=list(OBJECTIVES),
        choices=list(OBJECTIVES),
        help="objectives to run; the first is the baseline of the printed ratios",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/objectives.json"))
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        default=None,
        help="print the table for the curves in these JSON files (earlier runs' --out) instead of running",
    )
    args = parser.parse_args()
    if args.report:
        report(merged_curves(args.report), args.gain, f"the curves of {', '.join(map(str, args.report))}")
        return
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {
            objective: [
                pool.submit(run, objective, seed, args.steps, args.eval_every, Path(tmp) / f"{objective}-{seed}")
                for seed in args.seeds
            ]
            for objective in args.objectives
        }
        curves = {objective: [f.result() for f in runs] for objective, runs in futures.items()}
    print(
        f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"(one thread per run){'' if not torch.accelerator.is_available() else ', ' + str(torch.accelerator.current_accelerator())}"
    )
    summary = report(
        curves, args.gain, f"seeds {args.seeds}, {args.jobs} run(s) in parallel, eval every {args.eval_every}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**summary, "curves": curves}, indent=1))
    plot(curves, summary["target"], args.out.with_suffix(".png"))
    print(f"curves: {args.out}, plot: {args.out.with_suffix('.png')}")


def report(curves: dict[str, list[list[dict]]], gain: float, how: str) -> dict[str, Any]:
    """Print the table of ``curves`` (the first objective the baseline); returns its figures."""
    baseline = next(iter(curves))
    base = curves[baseline][0][0]["accuracy"]
    target = base + gain / 100
    budget = min(c[-1]["nfe"] for runs in curves.values() for c in runs)
    rows = {}
    for objective, runs in curves.items():
        rows[objective] = {
            "nfe_to_target": mean([first_reaching(c, target, "nfe") for c in runs]),
            "seconds_to_target": mean([first_reaching(c, target, "seconds") for c in runs]),
            "nfe_cost": cost_to_target(runs, target, "nfe"),
            "seconds_cost": cost_to_target(runs, target, "seconds"),
            "mean_curve_nfe_to_target": mean_curve_reaching(runs, target),
            "reached": sum(first_reaching(c, target, "nfe") is not None for c in runs),
            "accuracy_at_budget": sum(accuracy_at(c, budget) for c in runs) / len(runs),
            "final_diversity": sum(c[-1]["diversity"] for c in runs) / len(runs),
            "nfe_per_step": sum(c[-1]["nfe"] / c[-1]["step"] for c in runs) / len(runs),
            "final_gains": [c[-1]["accuracy"] - c[0]["accuracy"] for c in runs],
        }
    steps = {o: runs[0][-1]["step"] for o, runs in curves.items()}
    print(
        f"quickstart world, {how}, steps {steps}; base held-out accuracy {100 * base:.1f}%, target "
        f"{100 * target:.1f}%, NFE budget {budget:,} (the largest every run covers)"
    )
    ref = rows[baseline]
    print(
        f"| objective | reached target | NFEs to target | vs {baseline} | seconds to target | vs {baseline} "
        f"| NFEs where the seeds' mean reaches it | vs {baseline} | NFEs per step | accuracy at budget "
        f"| gain at the end (per seed, points) | diversity |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for objective, row in rows.items():

        def ratio(key):
            if row[key] is None:
                return "n/a"
            baseline_cost, exact = ref[key.replace("_to_target", "_cost")]
            return f"{'' if exact else '>= '}{baseline_cost / row[key]:.1f}x"

        nfe = f"{row['nfe_to_target']:,.0f}" if row["nfe_to_target"] is not None else "not in every seed"
        sec = f"{row['seconds_to_target']:.0f} s" if row["seconds_to_target"] is not None else "not in every seed"
        on_mean, ref_mean = row["mean_curve_nfe_to_target"], ref["mean_curve_nfe_to_target"]
        mean_nfe = f"{on_mean:,.0f}" if on_mean is not None else "never"
        mean_ratio = f"{ref_mean / on_mean:.2f}x" if on_mean and ref_mean else "n/a"
        print(
            f"| {objective} | {row['reached']}/{len(curves[objective])} | {nfe} | {ratio('nfe_to_target')} | {sec} | "
            f"{ratio('seconds_to_target')} | {mean_nfe} | {mean_ratio} | {row['nfe_per_step']:.0f} | "
            f"{100 * row['accuracy_at_budget']:.1f}% | {' / '.join(f'{100 * g:+.1f}' for g in row['final_gains'])} | "
            f"{row['final_diversity']:.3f} |"
        )
    print("per-seed held-out accuracy (%) at each evaluation:")
    for objective, runs in curves.items():
        print(f"  {objective}: " + " | ".join(" ".join(f"{100 * p['accuracy']:.1f}" for p in c) for c in runs))
    return {"target": target, "base": base, "budget_nfe": budget, "rows": rows}


def plot(curves: dict[str, list[list[dict]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for objective, runs in curves.items():
        for i, curve in enumerate(runs):
            ax.plot(
                [p["nfe"] for p in curve],
                [100 * p["accuracy"] for p in curve],
                marker="o",
                markersize=3,
                color=f"C{list(curves).index(objective)}",
                alpha=0.8,
                label=objective if i == 0 else None,
            )
    ax.axhline(100 * target, color="grey", linestyle="--", label="target")
    ax.set_xlabel("transformer forward passes per run (NFEs, evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
