"""The plain data structures a training step passes along: ``Media`` and ``Rollout``.

Every backbone is a policy emitting a sequence of stochastic transitions; a ``Rollout`` records
them for a batch (states, per-transition log-probs) and each stage of a step adds its fields
(media, rewards, advantages) without reaching back into the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

MEDIA_KINDS = ("image", "video", "audio", "text")


@dataclass
class Media:
    """A batch of generated media of one kind.

    ``data`` layout by kind: image ``[B, C, H, W]`` and video ``[B, T, C, H, W]`` floats in [0, 1];
    audio ``[B, C, N]`` floats in [-1, 1]; text a ``list[str]``. ``meta`` holds fps, sample_rate, ...
    """

    kind: str
    data: torch.Tensor | list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in MEDIA_KINDS:
            raise ValueError(f"unknown media kind {self.kind!r}; expected one of {MEDIA_KINDS}")

    def __len__(self) -> int:
        return len(self.data)

    def select(self, index: torch.Tensor | list[int] | slice) -> Media:
        """The media of a subset of the batch."""
        if isinstance(self.data, list):
            idx = range(len(self.data))[index] if isinstance(index, slice) else [int(i) for i in index]
            return Media(self.kind, [self.data[i] for i in idx], dict(self.meta))
        return Media(self.kind, self.data[index], dict(self.meta))


@dataclass
class Rollout:
    """One rank's slice of a step's samples and everything computed about them.

    Batch-indexed tensors all share the first dimension ``B``. ``log_probs[b, i]`` is the log-prob of
    transition ``i`` of sample ``b`` under the policy that sampled it. What ``states`` holds is the
    policy's: a denoising trajectory ``x_0 .. x_S`` (``x_0`` the initial noise, ``x_S`` the final sample)
    as ``[B, S+1, ...]``, or a token policy's prompt and completion ids ``[B, P+T]``, whose ``mask``
    marks the real completion tokens.
    """

    prompts: list[str]
    sample_ids: torch.Tensor  # [B] index of each sample in the step's global batch
    group_ids: torch.Tensor  # [B] index of each sample's prompt group in the global batch
    conditions: dict[str, torch.Tensor]  # backbone-specific conditioning, batch-indexed
    states: torch.Tensor
    log_probs: torch.Tensor | None = None  # [B, S]
    mask: torch.Tensor | None = None  # [B, S] true for real transitions (token policies: not padding); None: all
    sigmas: torch.Tensor | None = None  # [S+1] noise levels of the states (denoising backbones)
    media: Media | None = None
    rewards: dict[str, torch.Tensor] = field(default_factory=dict)  # reward name -> [B]
    frame_rewards: dict[str, torch.Tensor] = field(default_factory=dict)  # video rewards' per-frame scores [B, T]
    reward: torch.Tensor | None = None  # [B] weighted total that advantages are computed from
    advantages: torch.Tensor | None = None  # [B], or [B, T] per frame (advantage.per_frame)
    preference: torch.Tensor | None = None  # [B, R] per-sample weights of the rewards (a Pareto run's); None: equal
    metrics: dict[str, float] = field(default_factory=dict)  # what making it measured, logged with its step
    tree_ancestors: torch.Tensor | None = None  # [B, S+1] tree rollouts: the node each sample passed at each level
    prompt_length: int | None = None  # token policies: ``states[:, :prompt_length]`` are the prompts' tokens
    truncated: torch.Tensor | None = None  # [B] token policies: completions cut off by the token budget
    kept_forwards: Any = None  # gyremedia.sampling.KeptForwards: forwards kept with their graphs for the first update
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_transitions(self) -> int:
        return self.log_probs.shape[1] if self.log_probs is not None else self.states.shape[1] - 1

    @property
    def final(self) -> torch.Tensor:
        """The last state of each denoising trajectory (the clean sample)."""
        return self.states[:, -1]

    def select(self, index: torch.Tensor | list[int] | slice, *, on_device: tuple[torch.Tensor, ...] = ()) -> Rollout:
        """A new Rollout with the samples at ``index`` (a slice gives views: not to be modified in place);
        non-batch fields are shared. ``on_device``: the same positions already copied to other devices, so none is
        copied there."""
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            raise TypeError("Rollout.select takes sample positions, not a mask: pass mask.nonzero().flatten()")
        if isinstance(index, slice):
            positions = list(range(len(self)))[index]
        else:  # a tensor index is read in one copy, not element by element (each would wait for its device)
            positions = index.tolist() if isinstance(index, torch.Tensor) else [int(i) for i in index]
        indices = {index.device: index} if isinstance(index, torch.Tensor) else {}  # one copy per device
        indices.update({copy.device: copy for copy in on_device})

        def take(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == len(self):
                if isinstance(index, slice):  # a view: no index to copy to the device
                    return value[index]
                if value.device not in indices:
                    indices[value.device] = torch.tensor(positions, dtype=torch.long, device=value.device)
                return value[indices[value.device]]
            if isinstance(value, dict):
                return {k: take(v) for k, v in value.items()}
            if isinstance(value, Media):
                return value.select(index if isinstance(index, slice) else positions)
            return value

        changes = {
            f.name: take(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in ("prompts", "sigmas")
        }
        return Rollout(prompts=[self.prompts[i] for i in positions], sigmas=self.sigmas, **changes)
