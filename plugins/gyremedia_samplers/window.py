"""MixGRPO's ODE/SDE window: stochastic steps only inside a window of the trajectory, ODE elsewhere.

Only the window's transitions carry log-probs (the others are recorded as NaN), so a ratio
objective trains on them alone: fewer noisy steps to sample and far fewer to train. The window is
``size`` consecutive transition indices starting at ``start``, cut off before the last two indices of
the trajectory, which are never stochastic (MixGRPO's ``max_timesteps = sampling_steps - 2``); where
it starts moves with training (``schedule``), as MixGRPO's ``GRPOTrainingStates`` moves it:

- ``progressive``: starts at 0 and moves ``stride`` indices later after every ``shift_every``
  training steps (MixGRPO's shift interval), back to 0 after the last index it may train;
- ``decay``: as progressive, but the shift interval shrinks linearly with the window's position,
  from ``shift_every`` at the start to ``min_shift_every`` at the end (the window keeps its size);
- ``random``: a new random start every training step (seeded, so a resume repeats it);
- ``fixed``: always the first ``size`` steps.

One difference from MixGRPO's code: when its window has moved past the last trainable index it spends
one shift interval empty (nothing stochastic, nothing trained) before rolling back; here it rolls back
at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import Transition
from gyremedia.options import OptionError, option
from gyremedia.runtime.streams import Stream, stream_rng
from gyremedia.sampling import stochastic_steps
from gyremedia_samplers.cps import CPSOptions, CPSSampler
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.ode import EulerODESampler

#: Transitions at the end of a trajectory that are never in the window (MixGRPO's ``sampling_steps - 2``).
UNTRAINED_TAIL = 2


@dataclass
class WindowOptions:
    sde: Literal["flow_sde", "cps"] = option("flow_sde", help="the stochastic step inside the window")
    noise_level: float = option(0.7, gt=0, help="that step's noise level")
    size: int = option(4, ge=1, help="stochastic steps per trajectory (MixGRPO's window size)")
    schedule: Literal["progressive", "decay", "random", "fixed"] = option("progressive", help="how the window moves")
    shift_every: int = option(
        25, ge=1, help="training steps between window moves (MixGRPO's shift interval; decay: the first, longest one)"
    )
    min_shift_every: int = option(1, ge=1, help="decay: the shift interval at the end of the trajectory")
    stride: int = option(1, ge=1, help="indices the window moves by at each shift (progressive, decay)")

    def validate(self) -> None:
        if self.sde == "cps" and self.noise_level > 1:
            raise OptionError("noise_level", "must be in (0, 1] for the cps step")
        if self.min_shift_every > self.shift_every:
            raise OptionError("min_shift_every", f"must be at most shift_every={self.shift_every}")


def window_start(train_step: int, last: int, options: WindowOptions) -> int:
    """Where a progressive or decaying window starts after ``train_step`` training steps, ``last`` the
    last index it may start at (MixGRPO's update rule, one cycle of positions repeated)."""
    starts = range(0, last + 1, options.stride)
    intervals = [options.shift_every] * len(starts)
    if options.schedule == "decay":  # linear in the position: shift_every at index 0, min_shift_every at the end
        progress = [start / (last + 1) for start in starts]
        intervals = [
            max(options.min_shift_every, int(options.shift_every * (1 - p) + options.min_shift_every * p))
            for p in progress
        ]
    step = train_step % sum(intervals)
    for start, interval in zip(starts, intervals):
        if step < interval:
            return start
        step -= interval
    raise AssertionError("unreachable: step < sum(intervals)")


class WindowSampler:
    """SDE steps inside the window, Euler ODE steps outside; replay always scores the SDE density."""

    has_log_prob = True
    prediction = "velocity"

    def __init__(self, options: WindowOptions, context=None) -> None:
        kernels = {
            "flow_sde": lambda: FlowSDESampler(FlowSDEOptions(noise_level=options.noise_level)),
            "cps": lambda: CPSSampler(CPSOptions(noise_level=options.noise_level)),
        }
        self.sde, self.ode = kernels[options.sde](), EulerODESampler()
        self.options = options
        self.seed = context.seed if context is not None else 0
        self.train_step = 0  # optimizer steps done: where the window sits

    def window(self, num_steps: int) -> range:
        """The transition indices sampled stochastically at the current training step."""
        o, k = self.options, self.train_step
        end = max(num_steps - UNTRAINED_TAIL, 1)  # first index never in the window (at least one step is)
        size = min(o.size, end)
        if o.schedule == "random":
            start = int(stream_rng(self.seed, k, Stream.WINDOW).integers(end - size + 1))
        elif o.schedule == "fixed":
            start = 0
        else:
            start = window_start(k, end - 1, o)
        return range(start, min(start + size, end))

    def stochastic_steps(self, sigmas: torch.Tensor) -> list[int]:
        """The window's steps (where its SDE step has noise)."""
        window = self.window(len(sigmas) - 1)
        return [i for i in stochastic_steps(self.sde, sigmas) if i in window]

    def step(self, x, model_output, sigmas, index, *, noise=None, next_state=None) -> Transition:
        if next_state is not None or index in self.window(len(sigmas) - 1):
            return self.sde.step(x, model_output, sigmas, index, noise=noise, next_state=next_state)
        transition = self.ode.step(x, model_output, sigmas, index)
        transition.log_prob = torch.full((x.shape[0],), float("nan"), device=x.device)
        return transition

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics) -> None:
        self.train_step = state.step
        metrics["sampler/window_start"] = float(self.window(len(state.rollout.sigmas) - 1).start)

    @hookimpl
    def gyremedia_on_load_checkpoint(self, state, path, plugin_state) -> None:
        self.train_step = state.step  # a resumed run's window sits where the interrupted one's did
