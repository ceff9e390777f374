"""The end of a run: the metrics plot, the held-out changes, the export, and the summary a person reads."""

from __future__ import annotations

import json
import logging
from typing import cast

import torch

from gyremedia import evaluation, hookimpl
from gyremedia.interfaces import Shardable
from gyremedia.media_io import plot_metrics
from gyremedia.runtime.runs import CHANGES_FILE, EXPORT_DIR, export_whole
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")


def heldout_changes(state: TrainState) -> dict[str, dict[str, float]]:
    """Every eval score (rewards, their parts, gold rewards), last step minus step 0 over the same samples,
    with a paired 95% interval; empty unless this run evaluated both."""
    base, final = state.eval_scores.get(0), state.eval_scores.get(state.config.core.train.steps)
    if not base or not final:
        return {}
    return {k: evaluation.paired_difference(base[k], final[k]) for k in sorted(final) if k in base}


@hookimpl(trylast=True)
def gyremedia_finish(state: TrainState) -> bool:
    """Main process: plot the metrics and export the trained generator into the run folder."""
    export, run_dir, config = state.config.core.export, state.run_dir, state.config
    if state.sharded and export.on_train_end:
        cast(Shardable, state.backbone).unshard()  # every process sends its shards; the main one gets the whole model
    if not state.accelerator.is_main_process:
        return True
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.is_file():
        shown = dict.fromkeys([f"eval/{evaluation.accuracy_key(config)}", *(f"eval/{s.name}" for s in config.rewards)])
        plot_metrics(metrics_file, run_dir / "reward_curve.png", eval_keys=list(shown))
    changes = heldout_changes(state)
    if changes:
        (run_dir / CHANGES_FILE).write_text(json.dumps(changes, indent=1))
    if export.on_train_end:
        # the run's own export folder: replaced whole (a resumed run that trained longer exports again)
        export_whole(state.backbone, run_dir / EXPORT_DIR, merge_lora=export.merge_lora)
        logger.info("exported the trained pipeline to %s", run_dir / EXPORT_DIR)
    return True


def _accuracy_line(state: TrainState) -> str | None:
    """The held-out accuracy at step 0 and at the end, with the paired gain and its interval."""
    key, last = evaluation.accuracy_key(state.config), state.config.core.train.steps
    base, final = (state.eval_scores.get(step, {}).get(key) for step in (0, last))
    if final is None:
        return None
    values = final[~torch.isnan(final)]
    fraction = bool(len(values)) and bool(((values >= 0) & (values <= 1)).all())
    show = (lambda v: f"{100 * v:.1f}%") if fraction else (lambda v: f"{v:.4g}")
    if base is None:
        return (
            f"held-out {key}: {show(evaluation.nanmean(final))} at step {state.step} "
            "(the base model was evaluated before the resume: `gyremedia eval` compares both)"
        )
    gain = evaluation.paired_gain(base, final)
    diff = (lambda v: f"{v:+.1f}") if fraction else (lambda v: f"{v / 100:+.4g}")
    unit = " points" if fraction else ""
    return (
        f"held-out {key}: {show(evaluation.nanmean(base))} at step 0 -> "
        f"{show(evaluation.nanmean(final))} at step {state.step}: {diff(gain['points'])}{unit} "
        f"(paired 95% interval {diff(gain['ci95_low'])} to {diff(gain['ci95_high'])}, "
        f"{gain['samples']} samples)"
    )


def summary_lines(state: TrainState, seconds: float) -> list[str]:
    """What a finished run learned and where its artifacts are (main process), a few lines for the terminal."""
    run, key = state.run_dir, evaluation.accuracy_key(state.config)
    minutes, seconds = divmod(round(seconds), 60)
    lines = [f"trained {state.step} steps in {minutes} min {seconds} s; run folder: {run}"]
    accuracy = _accuracy_line(state)
    if accuracy:
        lines.append(accuracy)
    changes = heldout_changes(state)
    others = [k for k in changes if k != key and "/" not in k.removeprefix("gold/")]  # each reward's own score
    if others:
        lines.append(
            "other held-out scores, trained - base (paired 95% interval): "
            + "; ".join(
                f"{k} {changes[k]['mean']:+.3g} ({changes[k]['ci95_low']:+.3g} to {changes[k]['ci95_high']:+.3g})"
                for k in others
            )
            + f"; all in {run / CHANGES_FILE}"
        )
    grids = sorted((str(p) for p in (run / "samples").glob("*") if p.stem in ("before", "after")), reverse=True)
    if grids:
        lines.append(f"samples: {', '.join(grids)}")
    if (run / "reward_curve.png").is_file():
        lines.append(f"plot:    {run / 'reward_curve.png'}")
    if (run / EXPORT_DIR).is_dir():
        lines.append(f"export:  {run / EXPORT_DIR} (its README.md shows how to load it)")
    lines.append(f"next:    gyremedia eval {run}    |    gyremedia train --resume {run} train.steps=N (train longer)")
    return lines
