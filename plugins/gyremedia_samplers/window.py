"""MixGRPO's ODE/SDE window: stochastic steps only inside a window of the trajectory, ODE elsewhere.

Only the window's transitions carry log-probs (the others are recorded as NaN), so a ratio
objective trains on them alone: fewer noisy steps to sample and far fewer to train. Where the window
sits moves with training (``schedule``):

- ``progressive``: starts at the noisiest steps and slides one step later every ``shift_every``
  training steps, wrapping around (MixGRPO's sliding window);
- ``decay``: starts at the noisiest steps, ``size`` wide, and loses one step every ``shift_every``
  training steps down to one;
- ``random``: a new random start every training step (seeded, so a resume repeats it);
- ``fixed``: always the first ``size`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gyremedia import hookimpl
from gyremedia.interfaces import Transition
from gyremedia.options import OptionError, option
from gyremedia.streams import Stream, stream_rng
from gyremedia_samplers.cps import CPSOptions, CPSSampler
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.ode import EulerODESampler

@dataclass
class WindowOptions:
    sde: Literal["flow_sde", "cps"] = option("flow_sde", help="the stochastic step inside the window")
    noise_level: float = option(0.7, gt=0, help="that step's noise level")
    size: int = option(4, ge=1, help="stochastic steps per trajectory")
    schedule: Literal["progressive", "decay", "random", "fixed"] = option("progressive", help="how the window moves")
    shift_every: int = option(25, ge=1, help="training steps between window moves (progressive, decay)")

    def validate(self) -> None:
        if self.sde == "cps" and self.noise_level > 1:
            raise OptionError("noise_level", "must be in (0, 1] for the cps step")


class WindowSampler:
    """SDE steps inside the window, Euler ODE steps outside; replay always scores the SDE density."""

    has_log_prob = True
    prediction = "velocity"

    def __init__(self, options: WindowOptions, context=None) -> None:
        kernels = {"flow_sde": lambda: FlowSDESampler(FlowSDEOptions(noise_level=options.noise_level)),
                   "cps": lambda: CPSSampler(CPSOptions(noise_level=options.noise_level))}
        self.sde, self.ode = kernels[options.sde](), EulerODESampler()
        self.options = options
        self.seed = context.seed if context is not None else 0
        self.train_step = 0  # optimizer steps done: where the window sits

    def window(self, num_steps: int) -> range:
        """The transition indices sampled stochastically at the current training step."""
        o, k = self.options, self.train_step
        size = min(o.size, num_steps)
        if o.schedule == "decay":
            return range(max(size - k // o.shift_every, 1))
        if o.schedule == "random":
            start = int(stream_rng(self.seed, k, Stream.WINDOW).integers(num_steps - size + 1))
        elif o.schedule == "progressive":
            start = (k // o.shift_every) % (num_steps - size + 1)
        else:
            start = 0
        return range(start, start + size)

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
