"""The default implementation of every stage of a run, always loaded (pytest's ``essential_plugins``).

One module per stage: :mod:`~gyremedia.stages.rollout`, :mod:`~gyremedia.stages.scoring`,
:mod:`~gyremedia.stages.advantages`, :mod:`~gyremedia.stages.update`, :mod:`~gyremedia.stages.evaluate`,
:mod:`~gyremedia.stages.checkpointing` and :mod:`~gyremedia.stages.finish`; :mod:`~gyremedia.stages.build`
makes what they share. Each default is ``trylast``: a plugin takes a stage over by implementing its hook with
``tryfirst=True`` (docs/architecture.md), without a branch in the trainer.
"""

from gyremedia.stages.advantages import gyremedia_compute_advantages
from gyremedia.stages.checkpointing import gyremedia_save_checkpoint
from gyremedia.stages.evaluate import gyremedia_evaluate
from gyremedia.stages.finish import gyremedia_finish
from gyremedia.stages.rollout import gyremedia_collect_rollout
from gyremedia.stages.scoring import gyremedia_score_rollout
from gyremedia.stages.update import gyremedia_update

__all__ = [
    "gyremedia_collect_rollout",
    "gyremedia_score_rollout",
    "gyremedia_compute_advantages",
    "gyremedia_update",
    "gyremedia_evaluate",
    "gyremedia_save_checkpoint",
    "gyremedia_finish",
]
