"""The inverse dynamics model: which action turned frame ``t`` into frame ``t + 1``.

A small CNN with circular padding (the world is a torus), trained on real GridWalk transitions whose
frames draw the agent as a random blob half of the time, with pixel noise and blur: it must read the motion
in imperfect generated frames, and a world model must not score by drawing a bigger or odd agent. Its weights live in
``assets/world16/inverse_dynamics/`` (``python -m gyremedia_world.pretrain`` makes them).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from gyremedia_world.env import ACTIONS, transitions

WEIGHTS, CONFIG = "model.safetensors", "config.json"


class InverseDynamicsModel(nn.Module):
    """``logits [N, actions]`` from frames before and after ``[N, 3, H, W]`` in [0, 1]."""

    def __init__(self, width: int = 32, frame: int = 16) -> None:
        super().__init__()
        self.config = {"width": width, "frame": frame}
        conv = dict(kernel_size=3, padding=1, padding_mode="circular")
        self.features = nn.Sequential(
            nn.Conv2d(6, width, **conv),
            nn.GELU(),
            nn.Conv2d(width, 2 * width, stride=2, **conv),
            nn.GELU(),
            nn.Conv2d(2 * width, 2 * width, stride=2, **conv),
            nn.GELU(),
        )
        self.head = nn.Linear(2 * width * (frame // 4) ** 2, len(ACTIONS))

    def forward(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(torch.cat([before, after], dim=1) * 2 - 1).flatten(1))

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / WEIGHTS))
        (folder / CONFIG).write_text(json.dumps(self.config))

    @classmethod
    def load(cls, folder: str | Path) -> InverseDynamicsModel:
        folder = Path(folder)
        if not (folder / WEIGHTS).is_file():
            raise FileNotFoundError(
                f"no inverse dynamics model in {str(folder)!r} (expected {WEIGHTS} and {CONFIG}); "
                "`python -m gyremedia_world.pretrain` makes one"
            )
        model = cls(**json.loads((folder / CONFIG).read_text()))
        model.load_state_dict(load_file(str(folder / WEIGHTS)))
        return model.eval().requires_grad_(False)


def corrupt(frames: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Augment real frames toward what a world model draws: random blur and pixel noise."""
    blur = torch.rand(len(frames), 1, 1, 1, generator=generator) * 0.5
    smooth = nn.functional.avg_pool2d(nn.functional.pad(frames, (1, 1, 1, 1), mode="circular"), 3, stride=1)
    noise = torch.randn(frames.shape, generator=generator) * torch.rand(len(frames), 1, 1, 1, generator=generator) * 0.1
    return ((1 - blur) * frames + blur * smooth + noise).clamp(0, 1)


def train_inverse_dynamics(
    steps: int, seed: int, batch: int = 128, random_sprites: float = 0.5
) -> tuple[InverseDynamicsModel, float]:
    """Fit the model to real transitions (fresh ones every step), each frame drawing the agent as a random
    blob with probability ``random_sprites``; returns it and its last training loss."""
    torch.manual_seed(seed)
    rng, generator = np.random.default_rng([seed, 13]), torch.Generator().manual_seed(seed)
    model = InverseDynamicsModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        before, after, actions = (torch.from_numpy(a) for a in transitions(batch, rng, random_sprites=random_sprites))
        logits = model(corrupt(before, generator), corrupt(after, generator))
        loss = nn.functional.cross_entropy(logits, actions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval().requires_grad_(False), loss.item()


@torch.no_grad()
def accuracy_on_real(model: InverseDynamicsModel, count: int, seed: int) -> float:
    """Accuracy on ``count`` fresh real transitions (clean frames): the ceiling generated video is held to."""
    before, after, actions = (torch.from_numpy(a) for a in transitions(count, np.random.default_rng([seed, 14])))
    return float((model(before, after).argmax(1) == actions).float().mean())
