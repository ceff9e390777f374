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

import numpy as np
import torch

from gyremedia import hookimpl
from gyremedia.interfaces import Transition
from gyremedia_samplers.cps import CPSOptions, CPSSampler
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.ode import EulerODESampler

SCHEDULES = ("progressive", "decay", "random", "fixed")


@dataclass
class WindowOptions:
    sde: str = "flow_sde"  # the stochastic step inside the window: flow_sde | cps
    noise_level: float = 0.7  # that step's noise level
    size: int = 4  # stochastic steps per trajectory
    schedule: str = "progressive"  # progressive | decay | random | fixed
    shift_every: int = 25  # training steps between window moves (progressive, decay)


class WindowSampler:
    """SDE steps inside the window, Euler ODE steps outside; replay always scores the SDE density."""

    has_log_prob = True

    def __init__(self, options: WindowOptions, context=None) -> None:
        if options.schedule not in SCHEDULES:
            raise ValueError(f"sampler.schedule={options.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if options.size < 1 or options.shift_every < 1:
            raise ValueError("sampler.size and sampler.shift_every must be >= 1")
        kernels = {"flow_sde": lambda: FlowSDESampler(FlowSDEOptions(noise_level=options.noise_level)),
                   "cps": lambda: CPSSampler(CPSOptions(noise_level=options.noise_level))}
        if options.sde not in kernels:
            raise ValueError(f"sampler.sde={options.sde!r}: expected one of {', '.join(kernels)}")
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
            start = int(np.random.default_rng([self.seed, k, 3]).integers(num_steps - size + 1))
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
