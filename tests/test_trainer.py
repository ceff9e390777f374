"""The training loop end to end on the tiny model: on-policy ratios, hooks, checkpoints, resume."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import pytest
import torch

from compile_checks import train_eager_and_compiled
from gyremedia import hookimpl
from gyremedia.cli import main
from gyremedia.config import ConfigError
from gyremedia.plugins import PluginManager
from gyremedia.runtime.checkpoint import latest_checkpoint, list_checkpoints
from gyremedia.stages import rollout
from gyremedia.trainer import RewardError, Trainer
from gyremedia_features.forward_reuse import planned_forwards


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_steps(run_dir) -> list[dict]:
    return [m for m in read_metrics(run_dir) if "loss" in m]


@pytest.mark.parametrize(
    "lora,dtype,sampler,precision,compiled",
    [
        (False, "float32", "flow_sde", "none", False),
        (True, "float32", "flow_sde", "none", False),
        (True, "bfloat16", "flow_sde", "none", False),
        (True, "bfloat16", "cps", "none", False),
        (False, "bfloat16", "cps", "none", False),
        (False, "float32", "flow_sde", "bf16", False),
        (True, "float32", "cps", "bf16", False),
        pytest.param(True, "float32", "flow_sde", "bf16", True, marks=pytest.mark.slow),
    ],
    ids=[
        "full",
        "lora",
        "lora-bf16-flow_sde",
        "lora-bf16-cps",
        "full-bf16-cps",
        "full-autocast-flow_sde",
        "lora-autocast-cps",
        "lora-autocast-compiled",
    ],
)
def test_every_on_policy_ratio_is_exactly_one(make_config, tmp_path, lora, dtype, sampler, precision, compiled):
    """Also in bf16 (the base weights; LoRA adapters train in fp32) and under bf16 autocast with fp32 master
    weights (train.mixed_precision), where replay must reproduce the rollout's kernels exactly: the same chunk,
    the same batch shape, log-probs in fp32. Compiled too (train.compile: the rollout's and the update's graphs
    keep eager's bf16 casts; without that their ratios were 1 +- 2e-4)."""
    config = make_config(
        f"backbone.lora.enabled={lora}",
        f"backbone.dtype={dtype}",
        f"sampler.name={sampler}",
        "train.steps=3",
        "objective.timestep_fraction=0.67",
        f"train.mixed_precision={precision}",
        f"train.compile={compiled}",
    )
    Trainer(config, PluginManager()).train()
    steps = train_steps(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2, 3]
    for metrics in steps:
        # approx_kl = mean((logp - logp_old)^2) / 2 is exactly 0 only if every sample's ratio is exactly 1.
        assert metrics["approx_kl"] == 0.0 and metrics["ratio"] == 1.0 and metrics["clip_fraction"] == 0.0
        assert metrics["grad_norm"] > 0


def test_run_folder_holds_config_metrics_samples_and_checkpoints(make_config, tmp_path):
    Trainer(make_config("checkpoint.keep_last=1"), PluginManager()).train()
    run = tmp_path / "run"
    assert "noise_level: 0.7" in (run / "config.yaml").read_text()
    assert [c.name for c in list_checkpoints(run)] == ["step-000002"]
    files = {p.name for p in latest_checkpoint(run).iterdir()}
    assert {"trainable.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_rank0.pt"} <= files
    assert (run / "samples" / "before.png").is_file() and (run / "samples" / "after.png").is_file()
    assert (run / "reward_curve.png").is_file()
    metrics = read_metrics(run)
    assert metrics[0]["step"] == 0 and {"eval/jpeg_compressibility", "eval/jpeg_compressibility/size_kb"} <= set(
        metrics[0]
    )
    assert {"reward", "reward_std", "loss", "policy_loss", "lr", "time/rollout"} <= set(metrics[1])


def comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def test_resume_reproduces_an_uninterrupted_run(tiny_yaml, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", str(tiny_yaml), f"run.output_dir={straight}", "train.steps=4", "checkpoint.every=2"]) == 0
    assert main(["train", str(tiny_yaml), f"run.output_dir={split}", "train.steps=2", "checkpoint.every=2"]) == 0
    # A kill during the next checkpoint leaves a temporary folder behind: resume must ignore it.
    (split / "checkpoints" / ".tmp-step-000003").mkdir()
    assert main(["train", "--resume", str(split), "train.steps=4"]) == 0
    expected, resumed = train_steps(straight), train_steps(split)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert comparable(resumed[3]) == comparable(expected[3])
    assert comparable(resumed[2]) == comparable(expected[2])


def test_evaluating_more_often_changes_no_training_number(tiny_yaml, tmp_path):
    """Evaluations draw from their own fixed seeds: a run evaluated at every step trains exactly as one evaluated
    only at its first and last (the slow learning tests may evaluate less often than their configs)."""
    runs = {}
    for every in (1, 0):
        run = tmp_path / str(every)
        assert main(["train", str(tiny_yaml), f"run.output_dir={run}", "train.steps=3", f"eval.every={every}"]) == 0
        runs[every] = [
            {k: v for k, v in comparable(m).items() if not k.startswith(("eval/", "monitor/"))}
            for m in train_steps(run)
        ]
    assert len(runs[1]) == 3 and runs[1] == runs[0]
    assert sum("eval/jpeg_compressibility" in m for m in read_metrics(tmp_path / "1")) == 4


def test_prompts_encoded_ahead_in_a_thread_change_no_number(make_config, tmp_path):
    runs = []
    for prefetch in (True, False):
        trainer = Trainer(make_config(f"run.output_dir={tmp_path / str(prefetch)}", "train.steps=3"), PluginManager())
        trainer.setup()
        assert trainer.config.backbone.meta["prefetches"]  # declared by the diffusers backbones
        trainer.config.backbone.meta["prefetches"] = prefetch
        runs.append([comparable(trainer.train_step(step)) for step in range(3)])
    assert runs[0] == runs[1]


def test_fused_adamw_is_opt_in_and_trains_the_same_up_to_rounding(make_config, tmp_path):
    """train.fused_adamw builds AdamW's fused kernel (on this CPU); the default keeps the per-tensor loop, and
    both give the same weights up to float rounding after a few steps."""
    weights, fused = [], []
    for on in (False, True):
        trainer = Trainer(
            make_config(f"run.output_dir={tmp_path / str(on)}", "train.steps=3", f"train.fused_adamw={on}"),
            PluginManager(),
        )
        state = trainer.setup()
        for step in range(3):
            trainer.train_step(step)
        fused.append(bool(state.optimizer.param_groups[0]["fused"]))
        weights.append([p.detach().clone() for p in state.backbone.trainable_module().parameters() if p.requires_grad])
    assert fused == [False, True]
    for loop, kernel in zip(*weights):
        torch.testing.assert_close(kernel, loop, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,reference",
    [
        (("regularizers=[{name: gaussian_kl, weight: 0.1}]",), True),
        (("train.reuse_rollout_forward=true",), False),
        (("objective={name: nft, old_policy_decay: 0.5}", "sampler={name: ode}", "backbone.lora.enabled=true"), False),
    ],
    ids=["kl-reference", "reused-forwards", "nft-old-policy-lora"],
)
def test_compiled_policy_trains_like_the_eager_one_and_keeps_its_parameter_names(
    make_config, tmp_path, overrides, reference
):
    """train.compile compiles the network in place (rollout, training and the KL's reference copy; the rollout's
    kept forwards too; NFT's old weights, swapped into it): the update follows the eager run's up to the compiled
    kernels' rounding, and checkpoints keep the same names."""
    runs = train_eager_and_compiled(make_config, tmp_path, 2, *overrides)
    assert runs.compiled_modules == [[False] * (1 + reference), [True] * (1 + reference)]
    assert runs.graphs_ran and runs.same_names
    assert runs.eager.norm() > 0 and runs.relative_difference() < 1e-3  # 6e-6 here
    if "old_policy_gap" in runs.last_metrics[0]:  # the old weights swapped into the compiled module are used
        eager, compiled = (metrics["old_policy_gap"] for metrics in runs.last_metrics)
        assert eager > 0 and compiled == pytest.approx(eager, rel=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        ("train.num_minibatches=2",),
        ("objective.timestep_fraction=0.67",),
        ("sampler={name: cps}", "objective.timestep_fraction=1.0"),  # its last step is deterministic
        ("sampler={name: window, size: 1, shift_every: 1}", "rollout.num_steps=4", "objective.timestep_fraction=1.0"),
    ],
    ids=["first-of-two-minibatches", "one-minibatch", "cps", "mixgrpo-window"],
)
def test_reused_rollout_forwards_train_the_same_weights_with_fewer_forwards(make_config, tmp_path, overrides):
    """train.reuse_rollout_forward: the first minibatch trains on the forwards its rollout kept (the same chunk,
    the same kernels), so the weights are the same to the bit and every trained transition of that minibatch
    costs one forward fewer; later minibatches, after the first update, replay. The rollout keeps exactly the
    transitions trained: a sampler's deterministic steps (cps's last, those outside MixGRPO's moving window) are
    never planned."""
    weights, forwards, planned = [], [], []
    for reuse in (False, True):
        trainer = Trainer(
            make_config(
                f"run.output_dir={tmp_path / str(reuse)}",
                "train.steps=3",
                *overrides,
                f"train.reuse_rollout_forward={reuse}",
            ),
            PluginManager(),
        )
        state = trainer.setup()
        rows = []
        state.backbone.trainable_module().register_forward_pre_hook(
            lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        for step in range(3):
            planned.append(planned_forwards(state, step))
            trainer.train_step(step)
            assert planned[-1] == state.objective.micro_steps(state.rollout, step)
            assert state.rollout.kept_forwards is None  # no graph outlives its update
        forwards.append(sum(rows))
        weights.append([p.detach().clone() for p in state.backbone.trainable_module().parameters()])
    config = trainer.config.core
    first_minibatch = config.rollout.batch_size // config.train.num_minibatches
    assert forwards[0] - forwards[1] == sum(map(len, planned[3:])) * first_minibatch
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_each_steps_prompts_are_drawn_once(make_config, tmp_path, monkeypatch):
    """The rollout, the prefetch of the next step's prompts and DDPO's per-prompt history read one draw."""
    trainer = Trainer(make_config("train.steps=3", "advantage.history=4", "advantage.min_count=2"), PluginManager())
    trainer.setup()
    drawn = []
    original = trainer.state.prompts.groups_for_step
    monkeypatch.setattr(
        trainer.state.prompts, "groups_for_step", lambda seed, step, n: drawn.append(step) or original(seed, step, n)
    )
    for step in range(3):
        trainer.train_step(step)
    assert drawn == [0, 1, 2]


def test_resume_after_a_crash_drops_metrics_logged_after_the_checkpoint(tiny_yaml, tmp_path):
    run = tmp_path / "crashed"
    assert main(["train", str(tiny_yaml), f"run.output_dir={run}", "train.steps=3", "checkpoint.every=2"]) == 0
    (run / "checkpoints" / "step-000003").rename(run / "checkpoints" / ".tmp-step-000003")  # as if killed while saving
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    assert [m["step"] for m in read_metrics(run)] == [0, 1, 2, 3]


class Recorder:
    """A module-style plugin that records every lifecycle hook it sees."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.saved_state = None

    @hookimpl
    def gyremedia_configure(self, config, accelerator):
        self.calls.append("configure")

    @hookimpl
    def gyremedia_on_step_end(self, state, metrics):
        self.calls.append(f"step_end:{state.step}")
        metrics["recorder/advantage_mean"] = state.rollout.advantages.mean().item()

    @hookimpl
    def gyremedia_on_eval(self, state, media, metrics):
        self.calls.append(f"eval:{state.step}:{media.kind}:{len(media)}")

    @hookimpl
    def gyremedia_on_save_checkpoint(self, state, path):
        return {"saved_at": state.step}

    @hookimpl
    def gyremedia_on_load_checkpoint(self, state, path, plugin_state):
        self.saved_state = plugin_state

    @hookimpl
    def gyremedia_on_exception(self, state, exc):
        self.calls.append(f"exception:{type(exc).__name__}")

    @hookimpl
    def gyremedia_on_train_end(self, state):
        self.calls.append("train_end")


@dataclass
class ShapingOptions:
    bonus: float = 0.0
    nan_at_step: int = -1


class ShapedReward:
    """A selected component that implements the data-changing hooks itself."""

    kinds = {"image"}

    def __init__(self, options, context):
        self.options = options
        self.seen: list[str] = []

    def __call__(self, media, prompts):
        return media.data.mean(dim=(1, 2, 3))

    @hookimpl
    def gyremedia_after_rollout(self, state, rollout):
        self.seen.append(f"after_rollout:{len(rollout)}")

    @hookimpl
    def gyremedia_process_rewards(self, state, rollout, rewards):
        rewards["shaped"] = rewards["shaped"] + self.options.bonus
        if state.step == self.options.nan_at_step:
            rewards["shaped"][1] = float("nan")
        self.seen.append("process_rewards")


class ShapedRewardPlugin:
    @staticmethod
    @hookimpl
    def gyremedia_register_rewards(register):
        register("shaped", ShapedReward, options=ShapingOptions, kinds={"image"})


def test_lifecycle_hooks_are_called_in_order(make_config, tmp_path):
    recorder = Recorder()
    pm = PluginManager(extra_plugins=[recorder, ShapedRewardPlugin])
    config = make_config("rewards.0.name=shaped", "rewards.0.bonus=1.0", plugins=pm)
    state = Trainer(config, pm).train()
    assert recorder.calls == ["configure", "eval:0:image:6", "step_end:1", "eval:2:image:6", "step_end:2", "train_end"]
    assert abs(state.last_metrics["recorder/advantage_mean"]) < 1e-5
    assert state.rewards["shaped"].seen == ["after_rollout:8", "process_rewards"] * 2
    assert train_steps(tmp_path / "run")[0]["reward/shaped"] > 1.0  # the bonus reached the rewards

    resumed = Recorder()
    pm = PluginManager(extra_plugins=[resumed, ShapedRewardPlugin])
    Trainer(
        make_config("rewards.0.name=shaped", "rewards.0.bonus=1.0", "train.steps=3", plugins=pm), pm, resume=True
    ).train()
    assert resumed.saved_state["Recorder"] == {"saved_at": 2}


def test_non_finite_reward_fails_naming_reward_step_and_prompt(make_config):
    recorder = Recorder()
    pm = PluginManager(extra_plugins=[recorder, ShapedRewardPlugin])
    trainer = Trainer(make_config("rewards.0.name=shaped", "rewards.0.nan_at_step=1", plugins=pm), pm)
    with pytest.raises(RewardError) as info:
        trainer.train()
    message = str(info.value)
    assert "'shaped'" in message and "step 1" in message and "nan" in message
    assert repr(rollout.collect(trainer.state, 1).prompts[1]) in message
    assert recorder.calls[-1] == "exception:RewardError"


def test_reward_of_the_wrong_media_kind_is_refused(make_config):
    class AudioOnly:  # a factory function, not a class: it declares its capabilities to register()
        @staticmethod
        @hookimpl
        def gyremedia_register_rewards(register):
            register("loudness", lambda context: object(), kinds={"audio"})

    pm = PluginManager(extra_plugins=[AudioOnly])
    with pytest.raises(ConfigError, match="reward 'loudness' scores audio, but backbone 'flow_matching' makes image"):
        make_config("rewards.0.name=loudness", plugins=pm)


def test_kl_to_reference_runs_with_lora_and_full(make_config):
    for lora in (False, True):
        config = make_config(
            f"backbone.lora.enabled={lora}",
            "objective.kl_beta=0.1",
            "train.steps=1",
            f"run.output_dir={make_config().core.run.output_dir}-{lora}",
        )
        state = Trainer(config, PluginManager()).train()
        assert state.last_metrics["gaussian_kl/kl"] == 0.0  # on the first update the policy equals the reference
        assert torch.isfinite(torch.tensor(state.last_metrics["loss"]))


@dataclass
class PenaltyOptions:
    scale: float = 1.0


class VelocityPenalty:
    """A regularizer: the mean squared model output of the trained transition."""

    def __init__(self, options, context):
        self.scale = options.scale

    def __call__(self, *, state, rollout, outputs):
        return {"velocity_sq": self.scale * outputs["model_output"].float().pow(2).mean()}


class PenaltyPlugin:
    @staticmethod
    @hookimpl
    def gyremedia_register_regularizers(register):
        register("velocity_penalty", VelocityPenalty, options=PenaltyOptions)


def test_selected_regularizer_adds_its_weighted_terms_to_the_loss(make_config):
    pm = PluginManager(extra_plugins=[PenaltyPlugin])
    config = make_config(
        "train.steps=1", "regularizers=[{name: velocity_penalty, weight: 0.5, scale: 2.0}]", plugins=pm
    )
    metrics = Trainer(config, pm).train().last_metrics
    penalty = metrics["velocity_penalty/velocity_sq"]
    assert penalty > 0
    assert metrics["loss"] == pytest.approx(metrics["policy_loss"] + 0.5 * penalty, rel=1e-5)


class UnreliableReward:
    """Brightness, except that training samples 1 and 6 of each batch fail (NaN)."""

    kinds = {"image"}

    def __call__(self, media, prompts):
        scores = media.data.mean(dim=(1, 2, 3)).clone()
        if len(prompts) == 8:  # a training batch (evaluations score 6 samples)
            scores[[1, 6]] = float("nan")
        return scores

    @hookimpl
    def gyremedia_process_rewards(self, state, rollout, rewards):
        self.last = rollout


class UnreliablePlugin:
    @staticmethod
    @hookimpl
    def gyremedia_register_rewards(register):
        register("unreliable", lambda context: UnreliableReward(), kinds={"image"})


def test_drop_policy_trains_on_the_other_samples_and_counts_the_dropped(make_config):
    pm = PluginManager(extra_plugins=[UnreliablePlugin])
    with pytest.raises(RewardError, match="'unreliable' failed at step 0"):
        Trainer(make_config("rewards.0.name=unreliable", plugins=pm), pm).train()
    config = make_config(
        "rewards.0.name=unreliable",
        "rewards.0.on_failure=drop",
        "run.output_dir=" + str(make_config().core.run.output_dir) + "-drop",
        plugins=pm,
    )
    state = Trainer(config, pm).train()
    metrics = train_steps(state.run_dir)
    assert [m["reward/unreliable/dropped"] for m in metrics] == [2.0, 2.0]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    advantages = state.rollout.advantages
    assert advantages[1] == 0 and advantages[6] == 0  # dropped: no push either way
    for group in (slice(0, 4), slice(4, 8)):  # the others are normalised among themselves
        kept = [a for i, a in enumerate(advantages[group].tolist()) if a != 0]
        assert len(kept) == 3 and abs(sum(kept)) < 1e-5


class OverlapReward:
    """Records the optimizer step at which each rollout was sampled, and proves overlap: scoring
    a rollout waits until the next rollout has been sampled (it would time out if run serially)."""

    kinds = {"image"}

    def __init__(self, options, context):
        self.sampled_at: list[int] = []
        self.next_sampled = threading.Semaphore(0)
        self.last_step = options.steps - 1

    def __call__(self, media, prompts):
        if len(prompts) == 8 and len(self.sampled_at) - 1 < self.last_step:
            assert self.next_sampled.acquire(timeout=20), "the next rollout was not sampled during scoring"
        return media.data.mean(dim=(1, 2, 3))

    @hookimpl
    def gyremedia_after_rollout(self, state, rollout):
        self.sampled_at.append(state.step)
        if len(self.sampled_at) > 1:
            self.next_sampled.release()


@dataclass
class OverlapOptions:
    steps: int = 3


class OverlapPlugin:
    @staticmethod
    @hookimpl
    def gyremedia_register_rewards(register):
        register("overlap", OverlapReward, options=OverlapOptions, kinds={"image"})


def test_async_scoring_samples_the_next_rollout_while_this_one_is_scored(make_config):
    pm = PluginManager(extra_plugins=[OverlapPlugin])
    config = make_config("rewards.0.name=overlap", "rollout.async_scoring=true", "train.steps=3", plugins=pm)
    state = Trainer(config, pm).train()
    # rollout k+1 is sampled before the update on rollout k: at optimizer steps 0, 0, 1 (serially 0, 1, 2)
    assert state.rewards["overlap"].sampled_at == [0, 0, 1]
    assert [m["step"] for m in train_steps(state.run_dir)] == [1, 2, 3]


@dataclass
class NanOptions:
    at_step: int = 2  # the optimizer step (1-based) whose loss is NaN


class NanAtStep:
    """A regularizer whose term is NaN at one step: stands for a diverging loss."""

    def __init__(self, options, context):
        self.at_step = options.at_step

    def __call__(self, *, state, rollout, outputs):
        value = outputs["model_output"].float().pow(2).mean() * 0
        return {"blowup": value + float("nan") if state.step + 1 == self.at_step else value}


class NanPlugin:
    @staticmethod
    @hookimpl
    def gyremedia_register_regularizers(register):
        register("nan_at_step", NanAtStep, options=NanOptions)


def finite_weights(checkpoint) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(v).all() for v in load_file(str(checkpoint / "trainable.safetensors")).values())


def test_a_nan_loss_stops_the_run_at_its_step_and_checkpoints_stay_finite(make_config, tmp_path):
    from gyremedia.trainer import NonFiniteLoss

    pm = PluginManager(extra_plugins=[NanPlugin])
    config = make_config("regularizers=[{name: nan_at_step, at_step: 3}]", "train.steps=4", plugins=pm)
    trainer = Trainer(config, pm)
    with pytest.raises(NonFiniteLoss, match="step 3: loss, nan_at_step/blowup not finite") as info:
        trainer.train()
    assert "the last checkpoint (step-000002) holds finite weights" in str(info.value)
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["step-000001", "step-000002"]
    assert finite_weights(latest_checkpoint(tmp_path / "run"))
    assert all(torch.isfinite(p).all() for p in trainer.state.backbone.trainable_module().parameters())


def test_skip_drops_the_nonfinite_update_and_counts_it(make_config):
    pm = PluginManager(extra_plugins=[NanPlugin])
    config = make_config(
        "regularizers=[{name: nan_at_step, at_step: 2}]", "train.steps=3", "train.on_nonfinite=skip", plugins=pm
    )
    state = Trainer(config, pm).train()
    assert state.step == 3 and state.last_metrics["train/nonfinite_skipped"] == 1.0
    assert state.lr_scheduler.last_epoch == 2  # the skipped update did not advance the schedule
    assert finite_weights(latest_checkpoint(state.run_dir))


def test_checkpoints_follow_the_time_bound_and_hooks_see_the_folder_being_written(make_config, tmp_path):
    class WritesAFile:
        @hookimpl
        def gyremedia_on_save_checkpoint(self, state, path):
            assert path.name == f".tmp-step-{state.step:06d}" and path.parent.name == "checkpoints"
            (path / "extra.txt").write_text(str(state.step))

    pm = PluginManager(extra_plugins=[WritesAFile()])
    config = make_config(
        "train.steps=3",
        "checkpoint.every=100",
        "checkpoint.max_lost_seconds=0.001",
        "checkpoint.keep_last=5",
        plugins=pm,
    )
    Trainer(config, pm).train()
    saved = list_checkpoints(tmp_path / "run")
    assert [c.name for c in saved] == ["step-000001", "step-000002", "step-000003"]  # each step was overdue
    assert (saved[0] / "extra.txt").read_text() == "1"


SIGNALLING_CHILD = '''
import os, signal, sys
from gyremedia import hookimpl
from gyremedia.cli import main
from gyremedia.plugins import PluginManager
from gyremedia_rewards.compressibility import JpegCompressibility, JpegOptions


class SignalAtStep(JpegCompressibility):
    """JPEG size; it sends this process SIGTERM while it scores training step SIGNAL_AT (1-based)."""

    calls = 0

    def __call__(self, media, prompts):
        if len(prompts) == 8:  # a training batch; the evaluations score 6 samples
            SignalAtStep.calls += 1
            if SignalAtStep.calls == int(os.environ.get("SIGNAL_AT", "0")):
                os.kill(os.getpid(), signal.SIGTERM)
        return super().__call__(media, prompts)


class Plugin:
    @hookimpl
    def gyremedia_register_rewards(self, register):
        register("signal_at_step", SignalAtStep, options=JpegOptions)


plain_init = PluginManager.__init__
PluginManager.__init__ = lambda self, extra_plugins=(), load_entry_points=True: plain_init(
    self, [*extra_plugins, Plugin()], load_entry_points)
sys.exit(main(sys.argv[1:]))
'''


def test_sigterm_checkpoints_the_step_exits_nonzero_and_resume_reproduces_the_run(tiny_yaml, tmp_path):
    import os
    import subprocess
    import sys

    child = tmp_path / "child.py"
    child.write_text(SIGNALLING_CHILD)

    def run(*args, signal_at=0):
        env = {**os.environ, "SIGNAL_AT": str(signal_at)}
        return subprocess.run([sys.executable, str(child), *args], capture_output=True, text=True, env=env, timeout=300)

    common = ["rewards=[signal_at_step]", "train.steps=5", "checkpoint.every=100"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert run("train", str(tiny_yaml), f"run.output_dir={straight}", *common).returncode == 0
    interrupted = run("train", str(tiny_yaml), f"run.output_dir={split}", *common, signal_at=3)
    assert interrupted.returncode == 143  # 128 + SIGTERM
    assert (
        "SIGTERM received: stopped after step 3 with checkpoint " in interrupted.stderr
        and f"gyremedia train --resume {split}" in interrupted.stderr
    )
    assert [c.name for c in list_checkpoints(split)] == ["step-000003"]
    resumed = run("train", "--resume", str(split))
    assert resumed.returncode == 0, resumed.stderr
    assert [m["step"] for m in train_steps(split)] == [1, 2, 3, 4, 5]
    for got, want in zip(train_steps(split), train_steps(straight)):
        assert comparable(got) == comparable(want), {
            k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)
        }


def test_a_second_signal_exits_at_once(make_config, monkeypatch):
    import signal

    import gyremedia.runtime.signals as signals_module

    exits = []
    monkeypatch.setattr(signals_module.os, "_exit", exits.append)
    trainer = Trainer(make_config(), None)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the shell started pytest in the background
    with trainer.signals.handled(lambda: 1):
        handler = signal.getsignal(signal.SIGINT)
        assert handler is not before
        handler(signal.SIGINT, None)
        assert trainer.signals.received == signal.SIGINT and exits == []
        handler(signal.SIGINT, None)
    assert exits == [130]
    assert signal.getsignal(signal.SIGINT) is before  # restored after the run


def test_a_plugin_takes_the_rollout_stage_over_and_may_defer_to_the_policy(make_config):
    class EveryOtherStep:
        """Collects odd steps itself (here: the policy's rollout with its samples reversed); defers on even ones."""

        def __init__(self) -> None:
            self.requests = []

        @hookimpl(tryfirst=True)
        def gyremedia_collect_rollout(self, state, request):
            self.requests.append((request.step, list(request.sample_ids.tolist())))
            if request.step % 2 == 0:
                return None
            rollout = state.backbone.collect_rollout(request, state.sampler)
            return rollout.select(list(range(len(rollout)))[::-1])

    plugin = EveryOtherStep()
    pm = PluginManager(extra_plugins=[plugin])
    trainer = Trainer(make_config(plugins=pm), pm)
    trainer.train()
    assert plugin.requests == [(0, list(range(8))), (1, list(range(8)))]
    assert trainer.state.rollout.sample_ids.tolist() == list(range(8))[::-1]  # step 1's rollout was the plugin's


def test_processes_launched_together_but_running_alone_are_refused(make_config, monkeypatch):
    """WORLD_SIZE says 4 processes, but this one forms no group with the others: each would train its own copy."""
    from types import SimpleNamespace

    from gyremedia.trainer import resolve_sharding

    monkeypatch.setenv("WORLD_SIZE", "4")
    alone = SimpleNamespace(num_processes=1, distributed_type=SimpleNamespace(value="NO"))
    with pytest.raises(ConfigError, match="4 processes were launched but each runs alone"):
        resolve_sharding(make_config(), alone)
    monkeypatch.setenv("WORLD_SIZE", "1")
    deepspeed = SimpleNamespace(num_processes=1, distributed_type=SimpleNamespace(value="DEEPSPEED"))
    with pytest.raises(ConfigError, match="DeepSpeed launches are not supported: shard with FSDP2"):
        resolve_sharding(make_config(), deepspeed)
    fsdp = SimpleNamespace(num_processes=2, distributed_type=SimpleNamespace(value="FSDP"))
    assert resolve_sharding(make_config(), fsdp)  # train.sharding=auto follows the launch
    with pytest.raises(
        ConfigError, match="train.sharding=none on an FSDP launch: launch with configs/accelerate/ddp.yaml"
    ):
        resolve_sharding(make_config("train.sharding=none"), fsdp)  # accelerate would shard it


class DeadServerPlugin:
    """A reward whose server is down: every training call fails."""

    @staticmethod
    @hookimpl
    def gyremedia_register_rewards(register):
        def unreachable(media, prompts):
            raise ConnectionError("judge unreachable")

        register("dead", lambda context: unreachable, kinds={"image"})


def test_a_reward_that_drops_more_than_its_share_stops_the_run(make_config):
    """on_failure=drop with a server down: the run stops at the first step instead of training on nothing."""
    pm = PluginManager(extra_plugins=[DeadServerPlugin])
    config = make_config("rewards.0.name=dead", "rewards.0.on_failure=drop", "eval.every=0", plugins=pm)
    with pytest.raises(
        RewardError,
        match=r"^reward 'dead' dropped 8 of 8 samples over the last 1 step\(s\) up to step 0, "
        r"more than rewards.0.max_dropped=0.5 allows",
    ):
        Trainer(config, pm).train()
    assert not (config.core.run.output_dir and list_checkpoints(config.core.run.output_dir))
