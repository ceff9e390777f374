"""Every random stream of a run, named in one place.

A draw depends only on ``(run seed, step, stream, keys...)``: the same on one process or many, and
after a resume. Each stream has its own number, so no two draws share a sequence by accident.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


class Stream(IntEnum):
    """The independent random streams of a run (the numbers are part of what makes a run repeatable)."""

    INITIAL_NOISE = 0  # a sample's starting state x_0 (keyed by sample id, or group id with same_noise_in_group)
    STEP_NOISE = 1  # the noise of a sample's stochastic transitions
    RENOISE = 2  # forward-process objectives: re-noising levels and noise of clean samples
    PROMPTS = 3  # which prompts a step trains on
    PREFERENCE = 4  # a Pareto run's preference weights, one draw per prompt group
    MONITOR = 5  # the monitor's velocity-drift re-noising
    TREE_NODES = 6  # the transition noise of tree-rollout nodes
    TRANSITION_SELECTION = 7  # which transitions a ratio objective trains on in a step
    WINDOW = 8  # MixGRPO's random window start
    # A backbone's generation randomness that is not a denoising step (token sampling, ...).
    GENERATION = 9
    CANDIDATES = 10  # Sol-RL's candidate pool: each candidate's initial noise (keyed by group and index)


def stream_rng(seed: int, step: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A numpy generator for one draw of ``stream`` at ``step`` (``keys`` tell draws of the same step apart)."""
    return np.random.default_rng([seed, step, int(stream), *(int(k) for k in keys)])


def sample_generators(
    seed: int, step: int, stream: Stream | tuple[int, ...], ids: list[int], device: torch.device | str = "cpu"
) -> list[torch.Generator]:
    """One torch generator per id on ``device``, seeded from ``(seed, step, stream..., id)`` through numpy's
    SeedSequence.

    ``stream`` is a :class:`Stream`, or a tuple that starts with one and adds keys (a micro-step, a tree path).
    A generator on the device draws there (no host copy per draw); its numbers are the same on any number of
    processes of one device type, not across types (a CUDA generator is not the CPU's).
    """
    streams = [int(s) for s in stream] if isinstance(stream, tuple) else [int(stream)]
    generators = []
    for sample_id in ids:
        state = np.random.SeedSequence([seed, step, *streams, int(sample_id)]).generate_state(2, dtype=np.uint32)
        generators.append(torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1])))
    return generators
