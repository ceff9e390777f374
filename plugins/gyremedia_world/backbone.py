"""``video_world``: an action-conditioned video flow-matching world model on diffusers' Wan transformer.

Given a context frame and one action per frame, it generates the next clip of ``clip_frames`` frames
in pixel space (``[B, 3, T, H, W]`` in [-1, 1]); fed its own last frame as the next context it rolls
out autoregressively, clip after clip (:meth:`VideoWorldBackbone.generate_clips`).
Conditioning: the context frame and a one-hot action are concatenated to each frame's channels, and
the action sequence (one-hot action plus one-hot position) is also the cross-attention sequence,
so the model is a stock ``WanTransformer3DModel``. Flow convention as everywhere in gyremedia:
``x_sigma = (1 - sigma) x0 + sigma eps``, the model predicts ``v = eps - x0``.

Prompts are GridWalk episodes (``"episode 17: right up up stay"``, :mod:`gyremedia_world.env`): the
start state's frame is the context and the words are the commanded actions. A prompt may command several
clips; the model generates its last one, continuing from the environment's frame before it, or, in a training
rollout with ``rollout_clips > 1``, from the model's own last frame of the clips before it (generated once
per group: the model learns from its own rollouts, as it will be used).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gyremedia.backbones.denoising import DenoisingPolicy
from gyremedia.backbones.transformer_policy import LoraOptions, TransformerPolicy
from gyremedia.data import Prompt, prompt_fields
from gyremedia.interfaces import BuildContext, RolloutRequest, Sampler
from gyremedia.options import existing_folder, option
from gyremedia.rollout import Media, Rollout
from gyremedia.runtime.streams import Stream, sample_generators, stream_rng
from gyremedia.sampling import sample_trajectories
from gyremedia_world.env import ACTIONS, CLIP_FRAMES, FRAME, Episode, parse_prompt

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
    rollout_clips: int = option(
        1,
        ge=1,
        help="clips a training rollout continues an episode for: each group trains one target clip drawn from "
        "1..rollout_clips, after the clips before it, which the model generates itself once per group",
    )
    clip_curriculum: int = option(
        0, ge=0, help="steps over which the latest target clip grows from 1 to rollout_clips; 0 = from the start"
    )

    monitor_clips: int = option(
        4,
        ge=0,
        help="clips of the model's own rollouts the per-clip monitor follows at each evaluation (64 held-out "
        "episodes); 0 = none",
    )

    def capabilities(self) -> dict:
        """With own rollouts each process generates the clips before its own groups' targets, as many as they
        need: the processes run different model calls, which sharded (FSDP) training cannot."""
        return {"shardable": False} if self.rollout_clips > 1 else {}


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
    frame_dim = 2  # states are [B, 3, T, H, W]

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
        self._own_contexts: dict[str, torch.Tensor] = {}  # a rollout's prompts -> the model's own context frame
        self.transformer.to(self.device)
        self._prepare_training(options.lora, options.gradient_checkpointing, context.mixed_precision)

    # ------------------------------------------------------------------ policy

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``context [B, 3, H, W]`` in [-1, 1] and the last clip's ``actions [B, T]``. The context is the frame the
        clip continues from: the model's own within a rollout that generated the clips before it, else the
        environment's (the start frame for a one-clip prompt)."""
        episodes = [parse_prompt(p) for p in prompts]
        length = self.clip_frames
        wrong = [p for p, e in zip(prompts, episodes) if len(e.actions) % length]
        if wrong:
            raise ValueError(
                f"this world model generates clips of {length} frames, one action each; "
                f"prompt {wrong[0]!r} commands a number of actions that is not a multiple of {length}"
            )
        context = torch.stack(
            [
                self._own_contexts[p] if p in self._own_contexts else self.frame(e.context(len(e.actions) - length))
                for p, e in zip(prompts, episodes)
            ]
        )
        actions = torch.tensor([e.actions[-length:] for e in episodes], dtype=torch.long)
        return {"context": context.to(self.device), "actions": actions.to(self.device)}

    def frame(self, image) -> torch.Tensor:
        """An environment frame (``[3, H, W]`` numpy in [0, 1]) as a context in [-1, 1] on the device."""
        return torch.from_numpy(image).to(self.device) * 2 - 1

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

    def media(self, rollout: Rollout) -> Media:
        """The rollout's clips, each after the frame it continued from (``meta["context_frame"]``): the rewards
        then read the model's own context, not the environment's, where the rollout generated it."""
        clips = self.decode(rollout.final)
        context = (rollout.conditions["context"].float()[:, None] + 1) / 2
        return Media(
            "video", torch.cat([context.clamp(0, 1), clips.data], dim=1), {**clips.meta, "context_frame": True}
        )

    # ------------------------------------------------------------------ own rollouts

    def collect_rollout(self, request: RolloutRequest, sampler: Sampler) -> Rollout:
        """Sample each group's target clip (:class:`DenoisingPolicy`); with ``rollout_clips > 1`` the target is a
        later clip of the episode, continuing from the model's own frames (:meth:`own_contexts`)."""
        if self.options.rollout_clips == 1:
            return super().collect_rollout(request, sampler)
        episodes = self.target_episodes(request)
        prompts = [
            Prompt(episodes[g].text, prompt_fields(p)) for p, g in zip(request.prompts, request.group_ids.tolist())
        ]
        self._own_contexts = self.own_contexts(episodes, sampler, request)
        try:
            rollout = super().collect_rollout(dataclasses.replace(request, prompts=prompts), sampler)
        finally:
            self._own_contexts = {}
        rollout.metrics["rollout/target_clip"] = sum(len(e.actions) for e in episodes.values()) / (
            self.clip_frames * len(episodes)
        )
        return rollout

    def latest_clip(self, step: int) -> int:
        """The latest clip a rollout may target at ``step``: ``rollout_clips``, reached linearly over
        ``clip_curriculum`` steps from 1."""
        o = self.options
        if o.clip_curriculum == 0:
            return o.rollout_clips
        return 1 + int((o.rollout_clips - 1) * min(1.0, step / o.clip_curriculum))

    def target_episodes(self, request: RolloutRequest) -> dict[int, Episode]:
        """Each group's episode up to its target clip, drawn uniformly from the reachable ones: the prompt's
        actions first, then random actions (the same on every process: drawn from the group's id)."""
        latest, episodes = self.latest_clip(request.step), {}
        for prompt, group in zip(request.prompts, request.group_ids.tolist()):
            if group not in episodes:
                rng = stream_rng(request.seed, request.step, Stream.GENERATION, group)
                clips = 1 + int(rng.integers(latest))
                episodes[group] = parse_prompt(prompt).extended(clips, self.clip_frames, rng)
        return episodes

    @torch.no_grad()
    def own_contexts(
        self, episodes: dict[int, Episode], sampler: Sampler, request: RolloutRequest
    ) -> dict[str, torch.Tensor]:
        """The frame each episode's last clip continues from: the model's own last frame of the clips before it,
        generated clip after clip from the start frame, once per group (noise from the group's id and the clip)."""
        length, contexts = self.clip_frames, {g: self.frame(e.context()) for g, e in episodes.items()}
        clip = 0
        while todo := [g for g, e in episodes.items() if len(e.actions) > (clip + 1) * length]:
            actions = torch.tensor([episodes[g].actions[clip * length : (clip + 1) * length] for g in todo])
            final = self.next_clip(
                sampler,
                torch.stack([contexts[g] for g in todo]),
                actions.to(self.device),
                initial=sample_generators(request.seed, request.step, (Stream.GENERATION, clip, 0), todo),
                steps=sample_generators(request.seed, request.step, (Stream.GENERATION, clip, 1), todo),
                num_steps=request.settings.num_steps,
            )
            contexts.update(zip(todo, final[:, :, -1].clamp(-1, 1)))
            clip += 1
        return {episodes[g].text: context for g, context in contexts.items()}

    def next_clip(
        self,
        sampler: Sampler,
        context: torch.Tensor,
        actions: torch.Tensor,
        *,
        initial: list[torch.Generator],
        steps: list[torch.Generator],
        num_steps: int,
    ) -> torch.Tensor:
        """The clean states ``[B, 3, T, H, W]`` of the clip after ``context [B, 3, H, W]`` under ``actions [B, T]``."""
        conditions = {"context": context, "actions": actions}
        states, _, _ = sample_trajectories(
            self,
            sampler,
            conditions,
            initial_generators=initial,
            step_generators=steps,
            num_steps=num_steps,
            guidance_scale=1.0,
        )
        return states[:, -1]

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
            final = self.next_clip(
                sampler,
                context,
                actions[:, begin : begin + self.clip_frames],
                initial=sample_generators(seed, k, Stream.INITIAL_NOISE, ids),
                steps=sample_generators(seed, k, Stream.STEP_NOISE, ids),
                num_steps=num_steps,
            )
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
