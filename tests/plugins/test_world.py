"""GridWalk, the video_world backbone and its rewards: the world's rules, the rewards against the
environment's own frames, the backbone's conditioning, autoregressive clips, export and a training run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from gyremedia import hookimpl
from gyremedia.advantages import combined_advantages
from gyremedia.backbones.transformer_policy import LoraOptions
from gyremedia.cli import bundled_config, main
from gyremedia.config import ConfigError, RolloutSection, load_config, resolve_config
from gyremedia.interfaces import BuildContext, RolloutRequest
from gyremedia.options import validate
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Media
from gyremedia.trainer import Trainer, resolve_sharding
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_world.backbone import TinyWorldOptions, VideoWorldBackbone, VideoWorldOptions
from gyremedia_world.compare import compare
from gyremedia_world.env import (
    ACTIONS,
    AGENT_COLOURS,
    BACKGROUND,
    FRAME,
    Episode,
    WorldState,
    parse_prompt,
    random_episodes,
    render,
    start_state,
    transitions,
)
from gyremedia_world.rewards import (
    FidelityOptions,
    FidelityReward,
    InverseDynamicsOptions,
    InverseDynamicsReward,
    psnr,
    ssim,
)

CPU = BuildContext(device=torch.device("cpu"))


def clips(episodes: list[Episode]) -> Media:
    """The environment's own clips of ``episodes`` as video media."""
    return Media("video", torch.stack([torch.from_numpy(e.truth()) for e in episodes]))


def tiny_world(**options) -> VideoWorldBackbone:
    return VideoWorldBackbone(
        VideoWorldOptions(tiny=TinyWorldOptions(num_layers=1, attention_head_dim=8, ffn_dim=16), **options), CPU
    )


# ---------------------------------------------------------------------------- the world


def test_prompts_round_trip_and_bad_prompts_name_the_grammar():
    episode = parse_prompt("episode 17:  right up  up stay")
    assert episode == Episode(17, (4, 1, 1, 0)) and parse_prompt(episode.text) == episode
    with pytest.raises(ValueError, match="expected 'episode N: ' and actions among stay, up, down, left, right"):
        parse_prompt("episode 17: jump")


def test_every_move_changes_the_frame_and_the_sprite_wraps_around_the_torus():
    for episode in range(50):
        state = start_state(episode)
        frames = {a: render(state.step(a)) for a in range(len(ACTIONS))}
        assert np.array_equal(frames[0], render(state))
        assert all(not np.array_equal(frames[a], frames[b]) for a in frames for b in frames if a < b)
    corner = render(WorldState(FRAME - 2, FRAME - 2, colour=0, landmark_row=8, landmark_col=8))
    agent = np.argwhere(np.all(corner == np.array(AGENT_COLOURS[0], dtype=np.float32)[:, None, None], axis=0))
    assert {tuple(p) for p in agent} == {(r, c) for r in (14, 15, 0, 1) for c in (14, 15, 0, 1)}


def test_truth_follows_the_commanded_actions():
    episode = Episode(3, (4, 4, 1, 0))
    start, frames = start_state(3), episode.truth()
    moved = start.step(4).step(4).step(1)
    assert np.array_equal(frames[2], render(moved)) and np.array_equal(frames[3], frames[2])


def agent_pixels(frames: np.ndarray) -> np.ndarray:
    """``[N]``: how many pixels of each frame have an agent colour."""
    colours = np.array(AGENT_COLOURS, dtype=np.float32)[None, :, :, None, None]
    return np.any(np.all(frames[:, None] == colours, axis=2), axis=1).sum(axis=(1, 2))


def test_random_sprites_are_blobs_of_varied_size():
    plain, _, _ = transitions(64, np.random.default_rng(0))
    blobs, _, _ = transitions(64, np.random.default_rng(0), random_sprites=1.0)
    assert np.array_equal(agent_pixels(plain), np.full(64, 16))
    sizes = agent_pixels(blobs)
    assert sizes.max() <= 36 and (sizes < 16).any() and (sizes > 16).any()


# ---------------------------------------------------------------------------- rewards


def test_inverse_dynamics_recovers_the_environments_own_actions():
    """The shipped model reads every action back from real clips, and few from clips played with other actions."""
    reward = InverseDynamicsReward(InverseDynamicsOptions())
    episodes = random_episodes(128, seed=5, first_episode=500)
    real = reward(clips(episodes), [e.text for e in episodes])
    assert float(real["accuracy"].mean()) >= 0.99 and torch.equal(real["score"], real["accuracy"])
    assert float(real["log_likelihood"].mean()) > -0.1
    other_actions = [Episode(e.episode, tuple((a + 1) % len(ACTIONS) for a in e.actions)).text for e in episodes]
    wrong = reward(clips(episodes), other_actions)
    assert float(wrong["accuracy"].mean()) <= 0.05


def test_inverse_dynamics_rejects_prompts_of_another_clip_length():
    reward = InverseDynamicsReward(InverseDynamicsOptions(score="log_likelihood"))
    with pytest.raises(ValueError, match="commands 2 actions for clips of 4 frames"):
        reward(clips([Episode(1, (1, 2, 3, 4))]), ["episode 1: up down"])
    assert "expected one of accuracy, log_likelihood" in validate(InverseDynamicsOptions(score="f1"))[0]


def test_a_prompt_of_several_clips_is_scored_on_its_last_clip_from_the_frame_before_it():
    """A prompt of 3 clips: its last clip is scored against its own truth, read from the environment's frame before
    it, or from the media's first frame when the media starts with its context; per-frame scores mean to the score."""
    episodes = [e.extended(3, 4, np.random.default_rng(i)) for i, e in enumerate(random_episodes(32, seed=7))]
    prompts = [e.text for e in episodes]
    last = Media("video", torch.stack([torch.from_numpy(e.truth()[-4:]) for e in episodes]))
    identify, fidelity = InverseDynamicsReward(InverseDynamicsOptions()), FidelityReward(FidelityOptions())
    scores = identify(last, prompts)
    assert float(scores["accuracy"].mean()) >= 0.99 and torch.all(fidelity(last, prompts)["psnr"] == 50)
    assert scores["frames"].shape == (32, 4) and torch.allclose(scores["frames"].mean(1), scores["score"])
    assert torch.allclose(fidelity(last, prompts)["frames"].mean(1), fidelity(last, prompts)["score"])
    context = torch.stack([torch.from_numpy(e.context(8)) for e in episodes])[:, None]
    with_context = Media("video", torch.cat([context, last.data], dim=1), {"context_frame": True})
    assert torch.equal(identify(with_context, prompts)["frames"], scores["frames"])
    assert torch.equal(fidelity(with_context, prompts)["frames"], fidelity(last, prompts)["frames"])
    # another context frame (the episode's start): the first transition reads wrong, the others do not
    start = torch.stack([torch.from_numpy(e.context()) for e in episodes])[:, None]
    other = identify(Media("video", torch.cat([start, last.data], dim=1), {"context_frame": True}), prompts)
    assert float(other["frames"][:, 0].mean()) < 0.5 and float(other["frames"][:, 1:].mean()) >= 0.99


def test_fidelity_is_perfect_on_the_truth_and_falls_with_corruption():
    episodes = random_episodes(8, seed=6)
    reward, prompts = FidelityReward(FidelityOptions(score="ssim")), [e.text for e in episodes]
    perfect = reward(clips(episodes), prompts)
    assert torch.allclose(perfect["ssim"], torch.ones(8), atol=1e-4) and torch.all(perfect["psnr"] == 50)
    noisy = clips(episodes)
    noisy.data = (noisy.data + 0.1 * torch.randn(noisy.data.shape, generator=torch.Generator().manual_seed(0))).clamp(
        0, 1
    )
    corrupted = reward(noisy, prompts)
    assert torch.all(corrupted["ssim"] < 0.9) and torch.all(corrupted["psnr"] < 25)
    # one frame too late: the agent is in the wrong place
    late = Media("video", torch.cat([clips(episodes).data[:, :1], clips(episodes).data[:, :-1]], dim=1))
    moved = [i for i, e in enumerate(episodes) if e.actions[0] != 0]
    assert torch.all(reward(late, prompts)["ssim"][moved] < perfect["ssim"][moved])
    # the agent's overlap: whole on the truth, partial one frame late, none when the agent vanishes
    assert torch.all(perfect["agent"] == 1) and torch.all(reward(late, prompts)["agent"][moved] < 1)
    vanished = Media("video", torch.full_like(noisy.data, BACKGROUND))
    assert torch.all(FidelityReward(FidelityOptions(score="agent"))(vanished, prompts)["score"] == 0)


def test_psnr_and_ssim_match_their_definitions():
    a = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    b = (a + 0.05).clamp(0, 1)
    mse = ((a - b) ** 2).flatten(1).mean(1)
    assert torch.allclose(psnr(a, b), 10 * torch.log10(1 / mse))
    assert (
        torch.allclose(ssim(a, b), ssim(b, a))
        and torch.all(ssim(a, b) < 1)
        and torch.allclose(ssim(a, a), torch.ones(4))
    )


# ---------------------------------------------------------------------------- backbone


def test_a_group_shares_its_context_and_each_frame_gets_its_action():
    backbone = tiny_world()
    prompts = ["episode 4: up up left stay"] * 2 + ["episode 9: down right right up"]
    conditions = backbone.encode(prompts)
    assert torch.equal(conditions["context"][0], conditions["context"][1])
    assert torch.equal(conditions["context"][2], torch.from_numpy(render(start_state(9))) * 2 - 1)
    assert conditions["actions"].tolist() == [[1, 1, 3, 0], [1, 1, 3, 0], [2, 4, 4, 1]]
    x = backbone.sample_noise([torch.Generator().manual_seed(i) for i in range(3)])
    assert x.shape == (3, 3, 4, FRAME, FRAME)
    assert backbone.predict(x, torch.tensor(0.5), conditions).shape == x.shape
    media = backbone.decode(x)
    assert media.kind == "video" and media.data.shape == (3, 4, 3, FRAME, FRAME) and media.meta["fps"] == 4
    changed = dict(conditions, actions=conditions["actions"].flip(1))
    assert not torch.allclose(
        backbone.predict(x, torch.tensor(0.5), changed), backbone.predict(x, torch.tensor(0.5), conditions)
    )
    with pytest.raises(ValueError, match="clips of 4 frames"):
        backbone.encode(["episode 4: up up"])
    with pytest.raises(ValueError, match="rollout.guidance_scale=1"):
        backbone.predict(x, torch.tensor(0.5), conditions, guidance_scale=2.0)


def test_generated_clips_become_the_next_clips_context():
    backbone = tiny_world()
    seen = []
    predict = backbone.predict
    backbone.predict = lambda x, sigma, conditions, *a, **k: (
        seen.append(conditions) or predict(x, sigma, conditions, *a, **k)
    )
    context = backbone.encode(["episode 2: up up up up"])["context"]
    video = backbone.generate_clips(
        EulerODESampler(), context, torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]), seed=0, ids=[0], num_steps=2
    )
    assert video.shape == (1, 8, 3, FRAME, FRAME)
    assert torch.equal(seen[0]["context"], context) and seen[0]["actions"].tolist() == [[1, 1, 1, 1]]
    assert torch.allclose((seen[2]["context"] + 1) / 2, video[:, 3].clamp(0, 1)) and seen[2]["actions"].tolist() == [
        [2, 2, 2, 2]
    ]


def test_a_rollout_continues_each_group_from_the_models_own_frames():
    """With rollout_clips=3 each group targets clip 1, 2 or 3 of its episode; the clips before it are generated once
    per group by the model itself, whose last frame every member of the group continues from."""
    backbone = tiny_world(rollout_clips=3)
    prompts = [e.text for e in random_episodes(12, seed=3) for _ in range(2)]
    ids = torch.arange(len(prompts))
    request = RolloutRequest(
        step=5,
        seed=0,
        prompts=prompts,
        sample_ids=ids,
        group_ids=ids // 2,
        chunks=2,
        settings=RolloutSection(batch_size=24, group_size=2, num_steps=2),
    )
    generated = []
    next_clip = backbone.next_clip
    backbone.next_clip = lambda *a, **k: generated.append(next_clip(*a, **k)) or generated[-1]
    rollout = backbone.collect_rollout(request, EulerODESampler())
    episodes = [parse_prompt(p) for p in rollout.prompts]
    clips = [len(e.actions) // 4 for e in episodes]
    assert set(clips) == {1, 2, 3} and rollout.metrics["rollout/target_clip"] == sum(clips) / len(clips)
    assert [e.actions[:4] for e in episodes] == [parse_prompt(p).actions for p in prompts]  # the prompt's clip first
    assert len(generated) == 2 and len(generated[0]) == sum(c > 1 for c in clips[::2])  # once per group, not sample
    context, truth = (
        rollout.conditions["context"],
        torch.stack([backbone.frame(e.context(len(e.actions) - 4)) for e in episodes]),
    )
    for group in range(12):
        rows = slice(2 * group, 2 * group + 2)
        assert torch.equal(context[rows][0], context[rows][1]) and clips[2 * group] == clips[2 * group + 1]
        own = not torch.allclose(context[rows][0], truth[rows][0], atol=0.2)
        assert own == (clips[2 * group] > 1)  # the tiny random model's frames, not the environment's
    assert rollout.conditions["actions"].tolist() == [list(e.actions[-4:]) for e in episodes]
    media = backbone.media(rollout)
    assert media.meta["context_frame"] and media.data.shape == (24, 5, 3, FRAME, FRAME)
    assert torch.allclose(media.data[:, 0], ((context + 1) / 2).clamp(0, 1))
    assert backbone._own_contexts == {}  # encode reads the environment's frames again after the rollout
    again = tiny_world(rollout_clips=3).collect_rollout(request, EulerODESampler())
    assert again.prompts == rollout.prompts and torch.equal(again.final, rollout.final)  # a draw of (seed, step, group)


def test_the_latest_target_clip_grows_over_the_curriculum():
    backbone = tiny_world(rollout_clips=4, clip_curriculum=90)
    assert [backbone.latest_clip(step) for step in (0, 29, 30, 60, 89, 90, 500)] == [1, 1, 2, 3, 3, 4, 4]
    assert tiny_world(rollout_clips=4).latest_clip(0) == 4


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_reloads_the_same_model(tmp_path, lora):
    backbone = tiny_world(lora=LoraOptions(enabled=lora, rank=2))
    with torch.no_grad():
        for p in backbone.trainable_module().parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    backbone.save_pretrained(tmp_path / "out")
    reloaded = VideoWorldBackbone(VideoWorldOptions(pretrained=str(tmp_path / "out")), CPU)
    conditions = backbone.encode(["episode 1: left left up down"])
    x = backbone.sample_noise([torch.Generator().manual_seed(0)])
    with torch.no_grad():
        assert torch.allclose(
            backbone.predict(x, torch.tensor(0.3), conditions),
            reloaded.predict(x, torch.tensor(0.3), conditions),
            atol=1e-5,
        )
    assert json.loads((tmp_path / "out" / "world.json").read_text())["clip_frames"] == 4
    with pytest.raises(FileNotFoundError, match="python -m gyremedia_world.pretrain"):
        VideoWorldBackbone(VideoWorldOptions(pretrained=str(tmp_path)), CPU)


# ---------------------------------------------------------------------------- config and training

WORLD_YAML = """
run: {output_dir: RUN_DIR, seed: 0}
backbone: {name: video_world, tiny: {num_layers: 1, attention_head_dim: 8, ffn_dim: 16}}
sampler: {name: flow_sde}
objective: {name: grpo}
rewards: [{name: inverse_dynamics}]
monitor: {gold: [world_fidelity]}
data: {prompts: ["episode 1: up up left stay", "episode 2: down right right up"]}
rollout: {batch_size: 8, group_size: 4, num_steps: 3}
train: {steps: 2, learning_rate: 0.001}
eval: {samples: 4, grid_size: 4, metric: inverse_dynamics/accuracy}
logging: {loggers: [jsonl], progress: false}
"""


def world_config(tmp_path, *overrides):
    path = tmp_path / "world.yaml"
    path.write_text(WORLD_YAML.replace("RUN_DIR", str(tmp_path / "run")))
    return resolve_config(load_config(path, list(overrides)), PluginManager())


def test_a_reward_for_another_media_kind_fails_at_config_time(tmp_path):
    with pytest.raises(
        ConfigError,
        match="reward 'shapes_verifier' scores image, but backbone 'video_world' makes "
        "video: choose one of inverse_dynamics, jpeg_compressibility, videoalign, world_fidelity",
    ):
        world_config(tmp_path, "rewards.0.name=shapes_verifier")
    with pytest.raises(ConfigError, match="monitor.gold.0: reward 'clip_score' scores image"):
        world_config(tmp_path, "monitor.gold=[clip_score]")


@pytest.mark.parametrize("name", ["world_model_quickstart", "world_model_grpo"])
def test_the_world_model_configs_resolve(name):
    config = resolve_config(load_config(str(bundled_config(f"{name}.yaml")), []), PluginManager())
    assert config.backbone.name == "video_world" and [r.name for r in config.rewards] == [
        "inverse_dynamics",
        "world_fidelity",
    ]


def test_evaluating_more_often_changes_no_training_number(tmp_path):
    """Evaluations and the per-clip monitor's own rollouts draw from their own fixed seeds: a run evaluated at every
    step trains exactly as one evaluated only at its first and last (the slow quickstart test evaluates less often
    than its config)."""
    runs = []
    for every in (1, 0):
        (tmp_path / str(every)).mkdir()
        config = world_config(tmp_path / str(every), f"eval.every={every}", "backbone.monitor_clips=2", "train.steps=3")
        Trainer(config, PluginManager()).train()
        lines = [
            json.loads(line) for line in (tmp_path / str(every) / "run" / "metrics.jsonl").read_text().splitlines()
        ]
        runs.append(
            [
                {k: v for k, v in m.items() if not k.startswith(("time/", "eval/", "monitor/"))}
                for m in lines
                if "loss" in m
            ]
        )
    assert len(runs[0]) == 3 and runs[0] == runs[1]


@pytest.mark.parametrize("objective", ["grpo", "nft"])
def test_the_same_trainer_trains_the_world_model_and_saves_gifs(tmp_path, objective, capsys):
    overrides = ["objective.name=nft", "sampler.name=ode"] if objective == "nft" else []
    config = world_config(tmp_path, *overrides)
    Trainer(config, PluginManager()).train()
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval/inverse_dynamics/accuracy" in metrics[0] and "eval/gold/world_fidelity" in metrics[0]
    assert metrics[-1]["step"] == 2 and np.isfinite(metrics[-1]["loss"])
    for name in ("before", "after"):
        gif = Image.open(run / "samples" / f"{name}.gif")
        assert gif.n_frames == 4
    assert (run / "pipeline" / "transformer" / "config.json").is_file()
    assert main(["eval", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["metric"] == "inverse_dynamics/accuracy" and set(report["base"]) == {
        "accuracy",
        "log_likelihood",
        "diversity",
    }
    assert set(report["gold"]) == {
        "world_fidelity",
        "world_fidelity/psnr",
        "world_fidelity/ssim",
        "world_fidelity/agent",
    }
    if objective == "grpo":  # long autoregressive rollouts of the base and trained models
        report = compare(run, clips=2, episodes=3)
        assert [len(report[m]) for m in ("base", "trained")] == [2, 2]
        assert all(0 <= clip["id_accuracy"] <= 1 for m in ("base", "trained") for clip in report[m])
        assert Image.open(run / "samples" / "autoregressive.gif").n_frames == 8


class Captured:
    """Keeps every rollout the update stage receives (and lets the default stage update), registered for the run
    as a feature is."""

    def __init__(self) -> None:
        self.rollouts: list = []

    @hookimpl
    def gyremedia_setup(self, state, context):
        state.plugins.register_for_run(self.Stage(self.rollouts), name="captured:run")

    class Stage:
        def __init__(self, rollouts: list) -> None:
            self.rollouts = rollouts

        @hookimpl(tryfirst=True)
        def gyremedia_update(self, state, rollout, step):
            self.rollouts.append(rollout)


@pytest.mark.parametrize("objective", ["nft", "grpo"])
def test_per_frame_credit_normalises_each_frames_scores_within_its_group(tmp_path, objective):
    """advantage.per_frame: frame t's advantage is the group-relative advantage of the rewards' frame-t scores
    (combined as advantage.combine says), on rollouts that continue from the model's own frames; a ratio objective
    trains on the per-frame log-probs recorded while sampling."""
    overrides = ["advantage.per_frame=true", "backbone.rollout_clips=2", "backbone.monitor_clips=2"]
    overrides += ["objective={name: nft}", "sampler.name=ode"] if objective == "nft" else []
    both = "rewards=[{name: inverse_dynamics}, {name: world_fidelity, weight: 0.5}]"
    config = world_config(tmp_path, *overrides, both, "monitor.gold=[]", "advantage.combine=normalize_each")
    captured = Captured()
    Trainer(config, PluginManager(extra_plugins=[captured])).train()
    for rollout in captured.rollouts:
        scores = torch.stack([rollout.frame_rewards[s.name] for s in config.rewards], dim=1)  # [B, R, T]
        assert rollout.advantages.shape == (len(rollout), 4)
        for frame in range(4):
            weights = torch.tensor([1.0, 0.5])
            expected = combined_advantages(scores[:, :, frame], weights, rollout.group_ids, "normalize_each")
            torch.testing.assert_close(rollout.advantages[:, frame], expected)
        assert not torch.allclose(rollout.advantages, rollout.advantages[:, :1].expand(-1, 4))
        if objective == "grpo":  # the transition's log-prob is the mean of its frames'
            frames = rollout.extras["frame_log_probs"]
            assert frames.shape == (*rollout.log_probs.shape, 4)
            torch.testing.assert_close(frames.mean(dim=2), rollout.log_probs)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [m for m in metrics if "eval/clip2/inverse_dynamics/accuracy" in m]  # every clip index watched
    assert len(evaluations) == 2 and all(0 <= m["eval/clip2/gold/world_fidelity/psnr"] <= 50 for m in evaluations)
    assert "monitor/hacking/clip2" in evaluations[-1] and "eval/clip3/inverse_dynamics/accuracy" not in metrics[0]
    with pytest.raises(ConfigError, match="objective 'grpo_guard' has no per-frame loss: use nft, awm, grpo or gipo"):
        world_config(tmp_path, "advantage.per_frame=true", "objective={name: grpo_guard}")
    with pytest.raises(ConfigError, match="reward 'jpeg_compressibility' reports no per-frame scores: leave it out"):
        world_config(tmp_path, *overrides, "rewards.0.name=jpeg_compressibility")


def test_own_rollouts_are_not_sharded(tmp_path, monkeypatch):
    """Each process generates the clips before its own groups' targets, as many as they need: different model calls
    per process, which FSDP cannot run; one clip per rollout can be sharded."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    fsdp = SimpleNamespace(num_processes=2, distributed_type=SimpleNamespace(value="FSDP"))
    assert resolve_sharding(world_config(tmp_path), fsdp)
    with pytest.raises(ConfigError, match="backbone 'video_world' cannot be sharded"):
        resolve_sharding(world_config(tmp_path, "backbone.rollout_clips=2"), fsdp)
