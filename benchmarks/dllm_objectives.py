"""The diffusion-LLM objectives on the masked-diffusion quickstart: held-out gain, tokens per forward and NFEs.

    python benchmarks/dllm_objectives.py [--seeds 0 1 2] [--jobs 2] [--rows ...] [--out FILE]

Each row trains configs/dllm_quickstart.yaml with its overrides (ROWS) once per seed from the same base model
(assets/addition_masked), then measures it as ``gyremedia eval`` does: 512 greedy completions of the 256
held-out prompts, base and trained, the paired gain in exact match with its 95% interval, and the tokens per
forward of those completions (base and trained: the same decoding, so under a confidence threshold a surer model
decodes in fewer forwards). NFEs: every row of a network forward outside evaluation (rollout steps, replays,
old-policy and reference passes), per training sample; seconds: the training steps' wall time. One torch thread
per run, so parallel runs do not share cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from gyremedia.cli import main as gyremedia
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from objectives import CountingTrainer as ForwardCounting  # benchmarks/objectives.py

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "dllm_quickstart.yaml"
#: Parallel decoding: every token at least this sure is committed in the same forward (at least one per forward).
THRESHOLD = "backbone.confidence_threshold=0.9"
TPF = "eval/tokens_per_forward"
SPEED_REWARDS = "rewards=[addition_verifier, {name: tokens_per_forward, weight: 1.0}]"
#: row -> overrides of the quickstart; the first is the baseline.
ROWS = {
    # diffu-GRPO's recipe: token GRPO on the one-forward mean-field likelihood proxy
    "token_grpo_mean_field": ["backbone.likelihood=mean_field"],
    "token_grpo": [],  # the quickstart as it is: token GRPO on the exact per-step log-probs
    "stable_drl_mean_field": ["objective={name: stable_drl}", "backbone.likelihood=mean_field"],
    "stable_drl_elbo": ["objective={name: stable_drl}", "backbone.likelihood=elbo"],
    "egspo": ["objective={name: egspo}"],
    "egspo_3_steps": ["objective={name: egspo, steps_per_update: 3}"],
    # parallel decoding: the baseline's loss, then LightningRL's with the speed reward beside correctness
    "token_grpo_threshold": [THRESHOLD],
    "lightning_rl_threshold": [
        THRESHOLD,
        "objective={name: lightning_rl, epsilon_high: 0.28}",
        "advantage.combine=normalize_each",
        SPEED_REWARDS,
    ],
}


class CountingTrainer(ForwardCounting):
    """Counts network forward rows (``input_ids``) outside evaluation and times the training steps."""

    input_key = "input_ids"

    def record(self, step: int, metrics: dict) -> None:
        """Nothing to record: the run is measured as ``gyremedia eval`` measures it, after training."""


def run(row: str, seed: int, steps: int | None, out: Path) -> dict:
    """Train one row at one seed and evaluate it as ``gyremedia eval --json`` does."""
    torch.set_num_threads(1)
    overrides = [
        f"run.output_dir={out}",
        f"run.seed={seed}",
        "export.on_train_end=false",
        "logging.progress=false",
        "eval.every=1000000",
        *([f"train.steps={steps}", f"checkpoint.every={steps}"] if steps else []),
        *ROWS[row],
    ]
    pm = PluginManager()
    config = resolve_config(load_config(QUICKSTART, overrides), pm)
    trainer = CountingTrainer(config, pm)
    state = trainer.train()
    samples = config.core.train.steps * config.core.rollout.batch_size
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        gyremedia(["eval", str(out), "--json"])
    report = json.loads(printed.getvalue().strip().splitlines()[-1])
    evaluations = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if TPF in m]
    return {
        "row": row,
        "seed": seed,
        "base": report["base"]["accuracy"],
        "trained": report["trained"]["accuracy"],
        "gain": report["gain"],
        "tpf": [evaluations[0][TPF], evaluations[-1][TPF]],  # the evaluations' at the first and last step
        "nfe_per_sample": trainer.nfe / samples,
        "seconds": trainer.seconds,
        "steps": config.core.train.steps,
        "last_metrics": {k: v for k, v in state.last_metrics.items() if isinstance(v, float)},
    }


def report(results: dict[str, list[dict]]) -> None:
    print(f"{'row':<26}{'held-out gain (points)':>30}{'tokens/forward':>18}{'NFEs/sample':>13}{'minutes':>9}")
    for row, runs in results.items():
        if not runs:
            continue
        gains = [r["gain"]["points"] for r in runs]
        lows = [r["gain"]["ci95_low"] for r in runs]
        base_tpf, tpf = runs[0]["tpf"][0], np.mean([r["tpf"][1] for r in runs])
        print(
            f"{row:<26}{' / '.join(f'{g:+.1f}' for g in gains):>22} (low {min(lows):+.1f})"
            f"{base_tpf:>8.2f} -> {tpf:.2f}{np.mean([r['nfe_per_sample'] for r in runs]):>13.1f}"
            f"{np.mean([r['seconds'] for r in runs]) / 60:>9.1f}"
        )
    base = next(iter(results.values()))[0]["base"]
    print(f"base held-out exact match {100 * base:.1f}% (512 greedy completions of 256 held-out prompts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default: the quickstart's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one process and one torch thread each")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dllm_objectives.json"))
    parser.add_argument("--runs", type=Path, default=None, help="keep the run folders here (default: a temporary one)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        folder = args.runs or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        pool = stack.enter_context(ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")))
        futures = {
            row: [pool.submit(run, row, seed, args.steps, folder / f"{row}-{seed}") for seed in args.seeds]
            for row in args.rows
        }
        results: dict[str, list[dict]] = {}
        for row, runs in futures.items():
            for seed, future in zip(args.seeds, runs):
                try:
                    results.setdefault(row, []).append(future.result())
                except Exception as exc:  # one failed run is reported; the others' results are kept
                    print(f"{row} seed {seed} failed: {type(exc).__name__}: {exc}")
    print(f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} (one thread per run)")
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
