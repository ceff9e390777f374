"""GridWalk: a 2-D world with discrete actions, small enough to learn a video world model of on a CPU.

An agent (a 4x4 sprite in one of four colours) walks on a 16x16 torus in steps of 2 pixels; a 2x2
landmark of another colour stays put (the agent is drawn over it). The torus has no walls, so every
action changes the frame and an inverse dynamics model can, in principle, recover every action.

An episode is fixed by its seed (the start state) and its actions, so a prompt such as
``"episode 17: right up up stay"`` names the context frame, the commanded actions and the true next
frames at once: rewards recompute the ground truth from the prompt alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

FRAME = 16  # pixels per side
STEP = 2  # pixels the agent moves per action
SPRITE = 4  # agent side, pixels
LANDMARK = 2  # landmark side, pixels
ACTIONS = ("stay", "up", "down", "left", "right")
MOVES = {"stay": (0, 0), "up": (-STEP, 0), "down": (STEP, 0), "left": (0, -STEP), "right": (0, STEP)}
AGENT_COLOURS = ((1.0, 0.2, 0.2), (0.2, 1.0, 0.2), (0.3, 0.5, 1.0), (1.0, 1.0, 0.2))
LANDMARK_COLOUR = (1.0, 1.0, 1.0)
BACKGROUND = 0.1
CLIP_FRAMES = 4  # frames a world model generates per clip (one action each)
HELDOUT_SEED_OFFSET = 1_000_000  # held-out episodes use start states from this seed on


@dataclass(frozen=True)
class WorldState:
    """Where the agent is (top-left pixel, row and column), its colour, and the landmark's place."""

    row: int
    col: int
    colour: int
    landmark_row: int
    landmark_col: int

    def step(self, action: int) -> WorldState:
        dr, dc = MOVES[ACTIONS[action]]
        return WorldState(
            (self.row + dr) % FRAME, (self.col + dc) % FRAME, self.colour, self.landmark_row, self.landmark_col
        )


def start_state(episode: int) -> WorldState:
    """The start state of an episode: a deterministic function of its seed."""
    rng = np.random.default_rng([episode, 11])
    row, col, lrow, lcol = (int(v) for v in rng.integers(0, FRAME // STEP, size=4) * STEP)
    return WorldState(row, col, int(rng.integers(len(AGENT_COLOURS))), lrow, lcol)


def render(state: WorldState, sprite: np.ndarray | None = None) -> np.ndarray:
    """The frame ``[3, FRAME, FRAME]`` in [0, 1]; the sprite wraps around the torus's edges.

    ``sprite`` (a boolean mask, centred where the 4x4 sprite is) draws the agent with another shape.
    """
    frame = np.full((3, FRAME, FRAME), BACKGROUND, dtype=np.float32)
    frame[:, state.landmark_row : state.landmark_row + LANDMARK, state.landmark_col : state.landmark_col + LANDMARK] = (
        np.array(LANDMARK_COLOUR, dtype=np.float32)[:, None, None]
    )
    mask = np.ones((SPRITE, SPRITE), dtype=bool) if sprite is None else sprite
    offset = (SPRITE - mask.shape[0]) // 2
    rows = (state.row + offset + np.arange(mask.shape[0])) % FRAME
    cols = (state.col + offset + np.arange(mask.shape[1])) % FRAME
    colour = np.array(AGENT_COLOURS[state.colour], dtype=np.float32)[:, None]
    frame[:, rows[:, None], cols[None, :]] = np.where(
        mask[None], colour[..., None], frame[:, rows[:, None], cols[None, :]]
    )
    return frame


def rollout(state: WorldState, actions: list[int]) -> tuple[np.ndarray, WorldState]:
    """The frames ``[len(actions), 3, FRAME, FRAME]`` after each action, and the final state."""
    frames = []
    for action in actions:
        state = state.step(action)
        frames.append(render(state))
    return np.stack(frames), state


@dataclass(frozen=True)
class Episode:
    """A prompt's content: an episode seed and the actions commanded from its start state."""

    episode: int
    actions: tuple[int, ...]

    @property
    def text(self) -> str:
        return f"episode {self.episode}: " + " ".join(ACTIONS[a] for a in self.actions)

    def context(self, after: int = 0) -> np.ndarray:
        """The environment's own frame after the first ``after`` actions (the start state's by default): what a
        model continues from when it is given the true history."""
        state = start_state(self.episode)
        for action in self.actions[:after]:
            state = state.step(action)
        return render(state)

    def truth(self) -> np.ndarray:
        """The environment's own frames after each commanded action."""
        return rollout(start_state(self.episode), list(self.actions))[0]

    def extended(self, clips: int, clip_frames: int, rng: np.random.Generator) -> Episode:
        """The episode commanded for ``clips`` clips: its own actions, then actions drawn from ``rng``."""
        extra = rng.integers(len(ACTIONS), size=clips * clip_frames - len(self.actions))
        return Episode(self.episode, self.actions + tuple(int(a) for a in extra))


_PROMPT = re.compile(rf"^episode (\d+):((?: (?:{'|'.join(ACTIONS)}))+)$")


def parse_prompt(text: str) -> Episode:
    """Parse ``"episode N: a1 a2 ..."``; raises ``ValueError`` naming the grammar for anything else."""
    match = _PROMPT.match(" ".join(text.split()))
    if match is None:
        raise ValueError(
            f"not a GridWalk prompt: {text!r}; expected 'episode N: ' and actions among {', '.join(ACTIONS)}"
        )
    return Episode(int(match.group(1)), tuple(ACTIONS.index(a) for a in match.group(2).split()))


def random_episodes(count: int, seed: int, *, first_episode: int = 0, length: int = CLIP_FRAMES) -> list[Episode]:
    """``count`` episodes with consecutive seeds from ``first_episode`` and uniformly random actions."""
    rng = np.random.default_rng([seed, 12])
    return [
        Episode(first_episode + i, tuple(int(a) for a in rng.integers(len(ACTIONS), size=length))) for i in range(count)
    ]


def transitions(
    count: int, rng: np.random.Generator, *, random_sprites: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` random real transitions: frames before ``[N, 3, H, W]``, after, and the actions ``[N]``.

    Each frame draws, with probability ``random_sprites``, the agent as a random blob around its true
    place (2 to 6 pixels wide, pixels missing at random): an inverse dynamics model trained on them
    reads the agent's motion, not its exact shape, as it must on generated frames.
    """
    before, after, actions = [], [], rng.integers(len(ACTIONS), size=count)

    def sprite() -> np.ndarray | None:
        if rng.random() >= random_sprites:
            return None
        size = 2 * int(rng.integers(1, 4))  # even, so the blob stays centred on the 4x4 sprite
        return rng.random((size, size)) < rng.uniform(0.5, 1.0)

    for action in actions:
        state = start_state(int(rng.integers(2**31)))
        before.append(render(state, sprite()))
        after.append(render(state.step(int(action)), sprite()))
    return np.stack(before), np.stack(after), actions
