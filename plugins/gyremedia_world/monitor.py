"""Every clip index of the model's own rollouts watched while a world model trains (``monitor_clips``, 4 by default).

At each evaluation the first :data:`EPISODES` eval episodes are rolled out for ``monitor_clips`` clips, each
clip from the model's own last frame (fixed noise), and each clip ``k`` is logged with its proxy, the action
following the inverse dynamics model reads (``eval/clip<k>/inverse_dynamics/accuracy``), and its gold, the PSNR
against the environment's own frames (``eval/clip<k>/gold/world_fidelity/psnr``). A clip whose proxy rose while its
gold fell by more than ``monitor.tolerance`` since the last evaluation gets the reward-hacking warning
(``monitor/hacking/clip<k> = 1``), as the run-level monitor gives it for the first clip's rewards.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gyremedia import hookimpl
from gyremedia.evaluation import EvalResult, eval_prompts, hacking_warning
from gyremedia.state import TrainState
from gyremedia_world.compare import clip_scores, extend, own_rollouts
from gyremedia_world.env import parse_prompt

logger = logging.getLogger("gyremedia")

EPISODES = 64  # eval episodes rolled out at every evaluation (64 x monitor_clips clips)


def watch_every_clip(state: TrainState) -> None:
    """Register the per-clip monitor for a world-model run that asks for it (``backbone.monitor_clips``)."""
    clips = getattr(getattr(state.backbone, "options", None), "monitor_clips", 0)
    if clips:
        monitor = ClipMonitor(clips, state.config.core.monitor.tolerance)
        state.stateful["world_clips"] = monitor
        state.plugins.register_for_run(monitor, name="world_clips:run")


class ClipMonitor:
    """Proxy and gold of the model's own rollouts at every clip index, and the proxy-up-gold-down warning."""

    def __init__(self, clips: int, tolerance: float) -> None:
        self.clips, self.tolerance = clips, tolerance
        self.previous: dict[str, float] | None = None

    @hookimpl
    def gyremedia_after_eval(self, state: TrainState, step: int, result: EvalResult, metrics: dict[str, float]) -> None:
        config, backbone = state.config.core, state.backbone
        prompts = eval_prompts(state.config)[:EPISODES]
        episodes = [extend(parse_prompt(p), self.clips, backbone.clip_frames) for p in prompts]
        num_steps = config.eval.num_steps or config.rollout.num_steps
        sampler = state.eval_sampler or state.sampler
        video = own_rollouts(backbone, sampler, episodes, seed=config.eval.seed, num_steps=num_steps)
        truth = torch.stack([torch.from_numpy(e.truth()) for e in episodes])
        current: dict[str, float] = {}
        for k, clip in enumerate(clip_scores(video, truth, episodes, backbone.clip_frames), start=1):
            proxy, gold = f"eval/clip{k}/inverse_dynamics/accuracy", f"eval/clip{k}/gold/world_fidelity/psnr"
            current.update({proxy: clip["id_accuracy"], gold: clip["psnr"]})
            warning = hacking_warning(step, self.previous or {}, current, proxy, [gold], self.tolerance)
            if warning:
                logger.warning(warning)
            metrics[f"monitor/hacking/clip{k}"] = float(warning is not None)
        metrics.update(current)
        self.previous = current

    def state_dict(self) -> dict[str, Any]:
        return {"previous": self.previous}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous = state.get("previous")
