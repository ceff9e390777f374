"""The evaluation stage: fixed-seed samples of the held-out prompts, scored, shown in a grid."""

from __future__ import annotations

from gyremedia import evaluation, hookimpl
from gyremedia.runtime.distributed import raise_together
from gyremedia.state import TrainState


def grid_name(step: int, last: int) -> str:
    """The file name of the samples grid of the evaluation at ``step``."""
    return "before" if step == 0 else "after" if step == last else f"step-{step:06d}"


@hookimpl(trylast=True)
def gyremedia_evaluate(state: TrainState, step: int) -> dict[str, float]:
    """Score the fixed-seed eval samples (main process) and save a captioned grid of them.

    A sharded model computes on every process at once: then all of them generate and score, and the
    main one reports."""
    core, main = state.config.core, state.accelerator.is_main_process
    metrics: dict[str, float] = {}
    error = None
    try:  # the other processes wait at raise_together, which also tells them if this failed
        if main or state.sharded:
            preference = state.plugins.hook.gyremedia_eval_preference(config=state.config)
            result = evaluation.evaluate(
                state.config, state.backbone, state.eval_sampler, state.rewards, preference=preference, step=step
            )
            metrics = result.means()
            state.plugins.hook.gyremedia_after_eval(state=state, step=step, result=result, metrics=metrics)
        if main:
            evaluation.save_grid(
                result.media,
                result.prompts,
                state.run_dir / "samples" / f"{grid_name(step, core.train.steps)}.png",
                core.eval.grid_size,
            )
            if step in (0, core.train.steps):
                state.eval_scores[step] = dict(result.scores)
            state.plugins.hook.gyremedia_on_eval(state=state, media=result.media, metrics=metrics)
    except Exception as exc:  # noqa: BLE001 - re-raised on every process
        error = exc
    raise_together(state.accelerator, error)
    return metrics
