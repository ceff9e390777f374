"""``video_world``: an action-conditioned video flow-matching world model on diffusers' Wan transformer.

Given a context frame and one action per frame, it generates the next clip of ``clip_frames`` frames
in pixel space (``[B, 3, T, H, W]`` in [-1, 1]); fed its own last frame as the next context it rolls
out autoregressively, clip after clip (:meth:`VideoWorldBackbone.generate_clips`).
Conditioning: the context frame and a one-hot action are concatenated to each frame's channels, and
the action sequence (one-hot action plus one-hot position) is also the cross-attention sequence,
so the model is a stock ``WanTransformer3DModel``. Flow convention as everywhere in gyremedia:
``x_sigma = (1 - sigma) x0 + sigma eps``, the model predicts ``v = eps - x0``.

Prompts are GridWalk episodes (``"episode 17: right up up stay"``, :mod:`gyremedia_world.env`): the
start state's frame is the context and the words are the commanded actions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gyremedia.backbones.denoising import DenoisingPolicy
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy
from gyremedia.interfaces import BuildContext
from gyremedia.options import existing_folder, option
from gyremedia.rollout import Media
from gyremedia.runtime.streams import Stream, sample_generators
from gyremedia.sampling import sample_trajectories
from gyremedia_world.env import ACTIONS, CLIP_FRAMES, FRAME, parse_prompt

WORLD_FILE = "world.json"  # what the model was trained on: frame size, clip length, actions, fps


@dataclass
class TinyWorldOptions:
    """Sizes of a randomly initialised model (used when ``pretrained`` is unset)."""

    num_layers: int = option(4, ge=1, help="transformer blocks")
    num_attention_heads: int = option(4, ge=1, help="attention heads")
    attention_head_dim: int = option(16, ge=1, help="channels per head")
    ffn_dim: int = option(128, ge=1, help="feed-forward width")
    clip_frames: int = option(CLIP_FRAMES, ge=1, help="frames per generated clip")
    seed: int = option(0, ge=0, help="seed of the random weights")


@dataclass
class VideoWorldOptions:
    pretrained: str | None = option(
        None,
        check=existing_folder("a folder written by `python -m gyremedia_world.pretrain`"),
        help="folder written by `python -m gyremedia_world.pretrain`; None builds `tiny`",
    )
    tiny: TinyWorldOptions = field(default_factory=TinyWorldOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)
    gradient_checkpointing: bool = option(False, help="recompute activations in the backward pass (less memory)")
    fps: int = option(4, ge=1, help="playback rate of the media it decodes to")


def build_tiny_world(options: TinyWorldOptions):
    """A random ``WanTransformer3DModel`` for pixel clips: inputs = noisy frame, context, action planes."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    torch.manual_seed(options.seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=options.num_attention_heads,
        attention_head_dim=options.attention_head_dim,
        in_channels=3 + 3 + len(ACTIONS),
        out_channels=3,
        text_dim=len(ACTIONS) + options.clip_frames,
        freq_dim=32,
        ffn_dim=options.ffn_dim,
        num_layers=options.num_layers,
        rope_max_seq_len=64,
    )
    world = {"frame": FRAME, "clip_frames": options.clip_frames, "actions": list(ACTIONS)}
    return transformer, FlowMatchEulerDiscreteScheduler(shift=1.0), world


class VideoWorldBackbone(TransformerPolicy, DenoisingPolicy):
    """A video world model seen as a policy over denoising transitions of one clip."""

    media_kind = "video"
    prediction = "velocity"

    def __init__(self, options: VideoWorldOptions, context: BuildContext) -> None:
        self.options = options
        self.device = context.device
        if options.pretrained:
            from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

            folder = Path(options.pretrained)
            if not (folder / WORLD_FILE).is_file():
                raise FileNotFoundError(
                    f"backbone.pretrained={options.pretrained!r} has no {WORLD_FILE}: point it at a "
                    "folder written by `python -m gyremedia_world.pretrain` or by a video_world export"
                )
            self.transformer = WanTransformer3DModel.from_pretrained(folder / "transformer")
            self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler")
            self.world = json.loads((folder / WORLD_FILE).read_text())
        else:
            self.transformer, self.scheduler, self.world = build_tiny_world(options.tiny)
        if self.world["actions"] != list(ACTIONS):
            raise ValueError(
                f"{options.pretrained}: trained on actions {self.world['actions']}, this world has {list(ACTIONS)}"
            )
        self.clip_frames = int(self.world["clip_frames"])
        self.transformer.to(self.device)
        self._prepare_training(options.lora, options.gradient_checkpointing, context.mixed_precision)

    # ------------------------------------------------------------------ policy

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``context [B, 3, H, W]`` in [-1, 1] (the episode's start frame) and ``actions [B, T]``."""
        episodes = [parse_prompt(p) for p in prompts]
        wrong = [p for p, e in zip(prompts, episodes) if len(e.actions) != self.clip_frames]
        if wrong:
            raise ValueError(
                f"this world model generates clips of {self.clip_frames} frames, one action each; "
                f"prompt {wrong[0]!r} commands a different number"
            )
        context = torch.stack([torch.from_numpy(e.context()) for e in episodes]) * 2 - 1
        actions = torch.tensor([e.actions for e in episodes], dtype=torch.long)
        return {"context": context.to(self.device), "actions": actions.to(self.device)}

    def sample_noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        shape = (3, self.clip_frames, self.world["frame"], self.world["frame"])
        return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(self.device)

    def predict(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        conditions: dict[str, torch.Tensor],
        guidance_scale: float = 1.0,
        *,
        reference: bool = False,
    ) -> torch.Tensor:
        """The velocity of clip states ``x [B, 3, T, H, W]`` at ``sigma`` (scalar or ``[B]``)."""
        if guidance_scale != 1.0:
            raise ValueError("video_world has no unconditional branch for guidance: set rollout.guidance_scale=1")
        batch, _, frames, height, width = x.shape
        context = conditions["context"].to(x.dtype)[:, :, None].expand(-1, -1, frames, -1, -1)
        actions = F.one_hot(conditions["actions"], len(ACTIONS)).to(x.dtype)  # [B, T, A]
        planes = actions.permute(0, 2, 1)[..., None, None].expand(-1, -1, -1, height, width)
        positions = torch.eye(frames, dtype=x.dtype, device=x.device).expand(batch, -1, -1)
        timestep = (sigma * 1000).to(x.dtype).reshape(-1).expand(batch)
        return self._forward(
            reference,
            hidden_states=torch.cat([x, context, planes], dim=1),
            timestep=timestep,
            encoder_hidden_states=torch.cat([actions, positions], dim=2),
        )

    @torch.no_grad()
    def decode(self, final: torch.Tensor) -> Media:
        """Video media ``[B, T, 3, H, W]`` in [0, 1]."""
        frames = (final.float().permute(0, 2, 1, 3, 4) + 1) / 2
        return Media("video", frames.clamp(0, 1), {"fps": self.options.fps})

    @torch.no_grad()
    def generate_clips(
        self, sampler, context: torch.Tensor, actions: torch.Tensor, *, seed: int, ids: list[int], num_steps: int
    ) -> torch.Tensor:
        """Roll out autoregressively: clip ``k`` continues from the last frame clip ``k - 1`` generated.

        ``context [B, 3, H, W]`` in [-1, 1], ``actions [B, K * clip_frames]``; returns the video
        ``[B, K * clip_frames, 3, H, W]`` in [0, 1]. Clip ``k`` of sample ``i`` draws noise from ``(seed, k, i)``.
        """
        clips = []
        for k, begin in enumerate(range(0, actions.shape[1], self.clip_frames)):
            conditions = {"context": context, "actions": actions[:, begin : begin + self.clip_frames]}
            states, _, _ = sample_trajectories(
                self,
                sampler,
                conditions,
                initial_generators=sample_generators(seed, k, Stream.INITIAL_NOISE, ids),
                step_generators=sample_generators(seed, k, Stream.STEP_NOISE, ids),
                num_steps=num_steps,
                guidance_scale=1.0,
            )
            final = states[:, -1]
            clips.append(self.decode(final).data)
            context = final[:, :, -1].clamp(-1, 1)  # the frame as decoded: a valid image
        return torch.cat(clips, dim=1)

    # ------------------------------------------------------------------ export

    def save_pretrained(self, out_dir: Path, *, merge_lora: bool = True) -> None:
        """Write ``transformer/`` (a stock ``WanTransformer3DModel``; only the LoRA adapters, in
        ``transformer_lora/``, when ``merge_lora`` is false), ``scheduler/`` and ``world.json``."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.lora_enabled and not merge_lora:
            self.transformer.save_lora_adapter(out_dir / "transformer_lora")
        else:
            self._merged_transformer().save_pretrained(out_dir / "transformer")
        self.scheduler.save_pretrained(out_dir / "scheduler")
        (out_dir / WORLD_FILE).write_text(json.dumps(self.world, indent=1))
        (out_dir / "README.md").write_text(USAGE)


USAGE = """# Trained with gyremedia: a GridWalk video world model

`transformer/` is a stock diffusers `WanTransformer3DModel` (pixel space, 16x16 RGB frames) and
`scheduler/` its `FlowMatchEulerDiscreteScheduler`; `world.json` records the clip length and actions.
Diffusers has no action-conditioned video pipeline, so generate with gyremedia:

```python
import torch
from gyremedia.interfaces import BuildContext
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_world.backbone import VideoWorldBackbone, VideoWorldOptions

model = VideoWorldBackbone(VideoWorldOptions(pretrained="THIS_FOLDER"), BuildContext(device=torch.device("cpu")))
conditions = model.encode(["episode 17: right up up stay"])  # context frame of episode 17, four actions
video = model.generate_clips(EulerODESampler(), conditions["context"], conditions["actions"], seed=0, ids=[0],
                             num_steps=10)  # [1, 4, 3, 16, 16] in [0, 1]; pass 8 actions for two clips
```

or continue training with `backbone.name=video_world backbone.pretrained=THIS_FOLDER`.
"""
