"""Which objective learns the quickstart world fastest? NFEs and wall time to +10 and +20 held-out points.

    python benchmarks/objectives.py [--seeds 0 1 2] [--jobs 2] [--eval-every 10] [--gains 10 20] [--objectives ...]

Runs each objective's config (OBJECTIVES; the first named is the baseline of the ratios: by default Flow-GRPO's
recipe, configs/quickstart_grpo.yaml as it is) once per seed from the same base model, counting every
transformer forward row (NFEs: sampling, training, old-policy and reference passes, and an offline objective's
rollouts, written once before it trains; evaluation excluded) and the wall time of the training steps (and of
those rollouts; evaluation excluded). Held-out accuracy is measured every ``--eval-every`` steps on the
quickstart's 256 fixed-seed samples. For each target (base + each of ``--gains`` points) it prints the NFEs and
seconds at which the seeds' mean curve reaches it (each seed's accuracy linear between evaluations, averaged) and
their ratios to the baseline's, then the monitor's readings at the end: the held-out proxy (the verifier's
partial credit, what training maximises) beside the gain in held-out accuracy (every criterion met on unseen
prompts), the drift from the base and the in-group diversity. Writes the curves to ``--out`` (JSON) and a plot of
the mean curves beside it.

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
from gyremedia.offline import write_rollouts
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
FLOW_GRPO = CONFIGS / "quickstart_grpo.yaml"
NFT = CONFIGS / "quickstart_nft.yaml"  # DiffusionNFT's quickstart: 10-step ODE rollouts, what the rows below start from
QUICKSTART = CONFIGS / "quickstart.yaml"  # the quickstart: AWM on 10-step ODE rollouts
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
#: Rollouts of 5 ODE steps, evaluation at the quickstart's 10.
FIVE_STEPS = ["sampler={name: ode}", "rollout.num_steps=5", "eval.num_steps=10"]
#: Flow-GRPO's transition selection, for the objectives that replace its loss on its recipe.
CLIP = "clip_range: 1.0e-4, "  # GIPO and GRPO-Guard keep their own (a trust width, and the authors' 2e-6)
RECIPE_SELECTION = CLIP + "transition_selection: first, timestep_fraction: 0.3, skip_zero_advantage: true"
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
    # The seed objectives (docs/objectives.md), each with its paper's or its code's defaults. The replaying ones on
    # the Flow-GRPO recipe (its sampler, transitions, KL, minibatches and learning rate), the rest on the quickstart's.
    "spatial_grpo": (
        FLOW_GRPO,
        [
            f"objective={{name: spatial_grpo, {RECIPE_SELECTION}, credit_reward: shapes_surrogate}}",
            "rewards=[shapes_verifier, {name: shapes_surrogate, weight: 0}]",
        ],
        150,
    ),
    # The same with the clip widened for per-token ratios: a token averages 16 of the latent's 1024 elements, so its
    # log-ratio's spread is about sqrt(1024 / 16) = 8x the transition's, and 1e-4 clips most tokens of minibatch 2.
    "spatial_grpo_clip8e-4": (
        FLOW_GRPO,
        [
            f"objective={{name: spatial_grpo, {RECIPE_SELECTION.replace('1.0e-4', '8.0e-4')}, "
            "credit_reward: shapes_surrogate}",
            "rewards=[shapes_verifier, {name: shapes_surrogate, weight: 0}]",
        ],
        150,
    ),
    # The same with a uniform map: per-token ratios alone (the credit map's own effect is the difference).
    "spatial_grpo_uniform": (
        FLOW_GRPO,
        [f"objective={{name: spatial_grpo, {RECIPE_SELECTION.replace('1.0e-4', '8.0e-4')}}}"],
        150,
    ),
    "gipo": (FLOW_GRPO, [f"objective={{name: gipo, {RECIPE_SELECTION.replace(CLIP, '')}}}"], 150),
    "grpo_guard": (FLOW_GRPO, [f"objective={{name: grpo_guard, {RECIPE_SELECTION.replace(CLIP, '')}}}"], 150),
    "vgrpo": (NFT, ["objective={name: vgrpo}"], 100),
    "crd": (NFT, ["objective={name: crd, kl_beta: 0.1}"], 100),
    "dohf": (NFT, ["objective={name: dohf}"], 100),
    # Offline: OFFLINE_STEPS steps of the base model's ODE samples written and scored once (their NFEs counted at
    # the start of the curve), then trained on for every step.
    "gdro": (NFT, ["objective={name: gdro}"], 100),
    "nft": (NFT, [], 100),
    # The forward-process objectives train on clean samples from any sampler: their rollouts with half the ODE
    # steps (5), evaluated as every run is (10 steps), halve the sampling NFEs.
    "awm_5_steps": (QUICKSTART, ["rollout.num_steps=5"], 100),  # the quickstart with 5-step rollouts
    "vgrpo_5_steps": (NFT, ["objective={name: vgrpo}", *FIVE_STEPS], 100),
    "nft_5_steps": (NFT, FIVE_STEPS, 100),
    # Sol-RL's two-stage rollouts on DiffusionNFT: per prompt 16 initial noises sampled with 5 ODE steps and
    # scored; the 4 best and 4 worst are sampled again at full quality and trained on.
    "nft_two_stage": (NFT, ["rollout.candidates=16", "rollout.candidate_steps=5"], 100),
    "awm": (QUICKSTART, [], 100),  # the quickstart as it is
}
ACCURACY = "eval/shapes_verifier/correct"
PROXY = "eval/shapes_verifier"
#: Objectives trained on saved rollouts (gyremedia rollout), and how many steps of rollouts they get.
OFFLINE = {"gdro"}
OFFLINE_STEPS = 24
#: Every run also measures its drift from the base at each evaluation (the reward-hacking monitor's reading).
MONITOR = ["monitor.drift=true"]


class CountingTrainer(Trainer):
    """Counts transformer forward rows outside evaluation (the batch size of the forward's ``input_key``), times the
    training steps and records each evaluation (:meth:`record`)."""

    input_key = "hidden_states"

    def setup(self):
        state = super().setup()
        self.nfe, self.counting, self.seconds = 0, True, 0.0
        self.curve: list[dict] = []

        def count(module, args, kwargs):
            if self.counting:
                self.nfe += kwargs[self.input_key].shape[0]

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
        self.record(step, metrics)
        return metrics

    def record(self, step: int, metrics: dict) -> None:
        """Add an evaluation to the curve."""
        self.curve.append(
            {
                "step": step,
                "nfe": self.nfe,
                "seconds": self.seconds,
                "accuracy": metrics[ACCURACY],
                "proxy": metrics.get(PROXY),
                "diversity": metrics.get("eval/diversity"),
                "drift": metrics.get("eval/drift"),
            }
        )


def run(objective: str, seed: int, steps: int | None, eval_every: int, out: Path) -> list[dict]:
    """One training run's evaluation curve (one torch thread, so parallel runs do not share cores). An offline
    objective's rollouts are written first; their NFEs and seconds start its curve."""
    torch.set_num_threads(1)
    config, objective_overrides, default_steps = OBJECTIVES[objective]
    steps = steps or default_steps
    overrides = [
        f"run.output_dir={out}",
        f"run.seed={seed}",
        f"train.steps={steps}",
        f"eval.every={eval_every}",
        "export.on_train_end=false",
        f"checkpoint.every={steps}",
        "logging.progress=false",
        *MONITOR,
        *objective_overrides,
    ]
    paid = (0, 0.0)  # NFEs and seconds spent before training (writing an offline objective's rollouts)
    if objective in OFFLINE:
        saved, pm = out.with_name(out.name + "-rollouts"), PluginManager()
        writer = CountingTrainer(
            resolve_config(load_config(config, [*overrides, f"run.output_dir={saved}", "logging.loggers=[]"]), pm), pm
        )
        writer.setup()
        start = time.perf_counter()
        write_rollouts(writer, saved, OFFLINE_STEPS, trajectories=False)
        paid = (writer.nfe, time.perf_counter() - start)
        overrides.append(f"data.offline={saved}")
    pm = PluginManager()
    trainer = CountingTrainer(resolve_config(load_config(config, overrides), pm), pm)
    trainer.train()
    return [point | {"nfe": point["nfe"] + paid[0], "seconds": point["seconds"] + paid[1]} for point in trainer.curve]


def mean_curve_reaching(runs: list[list[dict]], target: float, key: str, points: int = 4001) -> float | None:
    """``key`` (nfe or seconds) at which the seeds' mean held-out accuracy first reaches ``target``: each seed's
    accuracy linear in ``key`` between its evaluations, averaged over seeds (None: never within every run)."""
    grid = np.linspace(0, min(c[-1][key] for c in runs), points)
    mean_accuracy = np.mean([np.interp(grid, [p[key] for p in c], [p["accuracy"] for p in c]) for c in runs], axis=0)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default: each objective's own)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process and one torch thread each")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--gains", type=float, nargs="+", default=[10.0, 20.0], help="targets: base accuracy + these many points"
    )
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
        report(merged_curves(args.report), args.gains, f"the curves of {', '.join(map(str, args.report))}")
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
        curves, args.gains, f"seeds {args.seeds}, {args.jobs} run(s) in parallel, eval every {args.eval_every}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**summary, "curves": curves}, indent=1))
    plot(curves, summary["targets"], args.out.with_suffix(".png"))
    print(f"curves: {args.out}, plot: {args.out.with_suffix('.png')}")


def report(curves: dict[str, list[list[dict]]], gains: list[float], how: str) -> dict[str, Any]:
    """Print the table of ``curves`` (the first objective the baseline); returns its figures."""
    baseline = next(iter(curves))
    base = float(np.mean([c[0]["accuracy"] for runs in curves.values() for c in runs]))
    targets = [base + gain / 100 for gain in gains]
    rows: dict[str, dict[str, Any]] = {}
    for objective, runs in curves.items():
        last = [c[-1] for c in runs]
        rows[objective] = {
            "reach": {
                f"+{gain:g}": {key: mean_curve_reaching(runs, target, key) for key in ("nfe", "seconds")}
                for gain, target in zip(gains, targets)
            },
            "nfe_per_step": float(np.mean([p["nfe"] / p["step"] for p in last])),
            "final_gains": [p["accuracy"] - c[0]["accuracy"] for p, c in zip(last, runs)],
            "final_proxy": mean_of([p.get("proxy") for p in last]),
            "final_drift": mean_of([p.get("drift") for p in last]),
            "final_diversity": mean_of([p.get("diversity") for p in last]),
            "base_diversity": mean_of([c[0].get("diversity") for c in runs]),
        }
    steps = {o: runs[0][-1]["step"] for o, runs in curves.items()}
    print(
        f"quickstart world, {how}, steps {steps}; base held-out accuracy {100 * base:.1f}%, targets "
        + ", ".join(f"+{g:g} = {100 * t:.1f}%" for g, t in zip(gains, targets))
    )
    reach_header = " | ".join(f"NFEs to +{g:g} | vs {baseline} | seconds to +{g:g} | vs {baseline}" for g in gains)
    print(
        f"| objective | {reach_header} | NFEs per step | gain at the end (per seed, points) | held-out proxy "
        "| drift | diversity (base) |"
    )
    print("|---|" + "---|" * (4 * len(gains) + 5))
    ref = rows[baseline]["reach"]
    for objective, row in rows.items():
        cells = []
        for gain in gains:
            for key in ("nfe", "seconds"):
                value, reference = row["reach"][f"+{gain:g}"][key], ref[f"+{gain:g}"][key]
                cells.append("never" if value is None else f"{value:,.0f}" + (" s" if key == "seconds" else ""))
                cells.append(f"{reference / value:.2f}x" if value and reference else "n/a")
        print(
            f"| {objective} | {' | '.join(cells)} | {row['nfe_per_step']:.0f} | "
            f"{' / '.join(f'{100 * g:+.1f}' for g in row['final_gains'])} | {fmt(row['final_proxy'])} | "
            f"{fmt(row['final_drift'])} | {fmt(row['final_diversity'])} ({fmt(row['base_diversity'])}) |"
        )
    print("per-seed held-out accuracy (%) at each evaluation:")
    for objective, runs in curves.items():
        print(f"  {objective}: " + " | ".join(" ".join(f"{100 * p['accuracy']:.1f}" for p in c) for c in runs))
    return {"targets": targets, "base": base, "rows": rows}


def mean_of(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else float(np.mean(values))


def fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def plot(curves: dict[str, list[list[dict]]], targets: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for objective, runs in curves.items():
        length = min(len(c) for c in runs)  # the seeds' evaluations, averaged point by point
        nfe = np.mean([[p["nfe"] for p in c[:length]] for c in runs], axis=0)
        accuracy = np.mean([[100 * p["accuracy"] for p in c[:length]] for c in runs], axis=0)
        ax.plot(nfe, accuracy, marker="o", markersize=2, label=f"{objective} (mean of {len(runs)})")
    for target in targets:
        ax.axhline(100 * target, color="grey", linestyle="--")
    ax.set_xlabel("transformer forward passes per run (NFEs, evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
