"""NoisySpeech, the speech_enhancement backbone and the speech metrics: the world's determinism and split,
the metrics against their definitions on known signals, the STFT round trip, replayed log-probs, the export
in a fresh process, and a whole run through the unchanged trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gyremedia.backbones.transformer_policy import LoraOptions
from gyremedia.cli import bundled_config, main
from gyremedia.config import ConfigError, load_config, resolve_config
from gyremedia.interfaces import BuildContext, ObjectiveContext
from gyremedia.media_io import read_wav
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Media, Rollout
from gyremedia.runtime.streams import sample_generators
from gyremedia.sampling import replay_transition, sample_trajectories
from gyremedia.trainer import Trainer
from gyremedia_samplers.flow_sde import FlowSDEOptions, FlowSDESampler
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_speech.backbone import SpeechEnhancementBackbone, SpeechEnhancementOptions, TinyEnhancerOptions
from gyremedia_speech.rewards import (
    DNSMOSOptions,
    DNSMOSReward,
    ESTOIReward,
    PESQReward,
    SISDRReward,
    dnsmos_segments,
    si_sdr,
)
from gyremedia_speech.stft import STFTSettings
from gyremedia_speech.world import CLIP_SAMPLES, HELDOUT_SENTENCES, SENTENCES, parse_prompt, split_prompts

CPU = BuildContext(device=torch.device("cpu"))
TRAIN, HELDOUT = split_prompts()


def tiny_enhancer(**options) -> SpeechEnhancementBackbone:
    return SpeechEnhancementBackbone(
        SpeechEnhancementOptions(tiny=TinyEnhancerOptions(block_out_channels=[8, 16]), **options), CPU
    )


def audio(waves: np.ndarray) -> Media:
    return Media("audio", torch.from_numpy(np.asarray(waves, dtype=np.float32))[:, None], {"sample_rate": 16000})


# ---------------------------------------------------------------------------- the world


def test_prompts_rebuild_the_same_utterance_and_bad_prompts_show_the_format():
    utterance = parse_prompt(TRAIN[3])
    assert utterance.prompt == TRAIN[3]
    (noisy, clean), (noisy2, clean2) = utterance.pair(), parse_prompt(TRAIN[3]).pair()
    assert (
        noisy.shape == clean.shape == (CLIP_SAMPLES,)
        and np.array_equal(noisy, noisy2)
        and np.array_equal(clean, clean2)
    )
    assert np.abs(noisy).max() <= 0.99 and not np.array_equal(noisy, clean)
    with pytest.raises(ValueError, match="not a NoisySpeech prompt: expected 'sentence N, voice VOICE"):
        parse_prompt("a red circle")


def test_heldout_utterances_differ_in_sentence_and_voice():
    train, heldout = [parse_prompt(p) for p in TRAIN], [parse_prompt(p) for p in HELDOUT]
    assert {u.sentence for u in train}.isdisjoint({u.sentence for u in heldout})
    assert {u.voice for u in train}.isdisjoint({u.voice for u in heldout})
    assert all(u.heldout for u in heldout) and not any(u.heldout for u in train)
    assert {u.sentence for u in heldout} == set(range(len(SENTENCES) - HELDOUT_SENTENCES, len(SENTENCES)))
    assert len({u.noise_kind for u in heldout}) == 5 and min(u.snr_db for u in heldout) == -5


@pytest.mark.parametrize("kind", ["white", "pink", "hum", "babble", "bursts"])
def test_every_noise_kind_mixes_at_its_snr(kind):
    utterance = parse_prompt(f"sentence 2, voice en+f2, rate 160, pitch 45: {kind} at 5 dB, noise 3")
    clean, noise = utterance.clean(), utterance.noise()
    snr = 10 * np.log10(np.mean(clean**2) / np.mean(noise**2))
    assert abs(snr - 5) < 1e-3


# ---------------------------------------------------------------------------- metrics


@pytest.fixture(scope="module")
def speech() -> tuple[np.ndarray, list[str]]:
    """Four clean held-out clips and their prompts."""
    prompts = HELDOUT[:4]
    return np.stack([parse_prompt(p).pair()[1] for p in prompts]), prompts


def test_identical_signals_score_the_metrics_maximum(speech):
    clean, prompts = speech
    assert torch.all(PESQReward()(audio(clean), prompts)["score"] > 4.4)  # P.862.2's ceiling is 4.64
    assert torch.all(ESTOIReward()(audio(clean), prompts)["score"] > 0.99)
    assert torch.all(SISDRReward()(audio(clean), prompts)["score"] == 60)  # the cap of +inf


def test_more_noise_lowers_every_score(speech):
    clean, prompts = speech
    rng = np.random.default_rng(0)
    white = rng.standard_normal(clean.shape)
    power = np.mean(clean**2, axis=1, keepdims=True)
    rewards = {
        "pesq": PESQReward(),
        "estoi": ESTOIReward(),
        "si_sdr": SISDRReward(),
        "dnsmos": DNSMOSReward(DNSMOSOptions()),
    }
    scores = {name: [] for name in rewards}
    for snr in (20, 10, 0):
        noisy = clean + white * np.sqrt(power * 10 ** (-snr / 10))
        for name, reward in rewards.items():
            scores[name].append(float(reward(audio(noisy), prompts)["score"].mean()))
    for name, values in scores.items():
        assert values[0] > values[1] > values[2], (name, values)
    assert abs(scores["si_sdr"][1] - 10) < 0.1  # SI-SDR of white noise added at 10 dB SNR is 10 dB


def test_si_sdr_is_scale_invariant_and_matches_its_definition():
    rng = np.random.default_rng(1)
    reference = torch.from_numpy(rng.standard_normal((2, 1000)))
    estimate = reference + 0.5 * torch.from_numpy(rng.standard_normal((2, 1000)))
    torch.testing.assert_close(si_sdr(3 * estimate, reference), si_sdr(estimate, reference))
    s, e = reference - reference.mean(-1, keepdim=True), estimate - estimate.mean(-1, keepdim=True)
    target = (e * s).sum(-1, keepdim=True) / (s * s).sum(-1, keepdim=True) * s
    expected = 10 * torch.log10((target**2).sum(-1) / ((e - target) ** 2).sum(-1))
    torch.testing.assert_close(si_sdr(estimate, reference), expected)


def test_dnsmos_repeats_a_short_clip_to_the_models_input_length():
    segments = dnsmos_segments(np.arange(CLIP_SAMPLES, dtype=np.float32))
    assert segments.shape == (1, 144160)  # 9.01 s at 16 kHz, one window for a clip doubled to 10.2 s
    assert np.array_equal(segments[0, CLIP_SAMPLES : 2 * CLIP_SAMPLES], np.arange(CLIP_SAMPLES))
    assert dnsmos_segments(np.zeros(16000 * 11, dtype=np.float32)).shape == (2, 144160)  # 1 s hops


def test_dnsmos_prefers_clean_speech_to_its_noisy_mixture(speech):
    clean, prompts = speech
    noisy = np.stack([parse_prompt(p).pair()[0] for p in prompts])
    reward = DNSMOSReward(DNSMOSOptions())
    clean_scores, noisy_scores = reward(audio(clean), prompts), reward(audio(noisy), prompts)
    assert set(clean_scores) == {"score", "ovrl", "sig", "bak"}
    assert float(clean_scores["ovrl"].mean()) > float(noisy_scores["ovrl"].mean()) + 0.3
    assert torch.all((clean_scores["ovrl"] > 1) & (clean_scores["ovrl"] < 5))


def test_intrusive_metrics_refuse_audio_of_another_rate(speech):
    clean, prompts = speech
    with pytest.raises(ValueError, match="speech metrics score mono 16000 Hz audio, got 1 channels at 8000 Hz"):
        PESQReward()(Media("audio", torch.from_numpy(clean)[:, None], {"sample_rate": 8000}), prompts)


# ---------------------------------------------------------------------------- the backbone


def test_the_stft_round_trip_is_lossless(speech):
    clean, _ = speech
    settings = STFTSettings()
    spec = settings.to_spec(torch.from_numpy(clean))
    assert spec.shape == (4, *settings.shape) == (4, 2, 128, 128)
    assert float((settings.to_wave(spec) - torch.from_numpy(clean)).abs().max()) < 1e-4


def test_a_group_shares_its_noisy_condition_and_decodes_to_audio():
    backbone = tiny_enhancer()
    conditions = backbone.encode([TRAIN[0], TRAIN[0], TRAIN[1]])
    assert conditions["noisy"].shape == (3, 2, 128, 128)
    assert torch.equal(conditions["noisy"][0], conditions["noisy"][1]) and not torch.equal(
        conditions["noisy"][0], conditions["noisy"][2]
    )
    v = backbone.predict(torch.randn(3, 2, 128, 128), torch.tensor(0.5), conditions)
    assert v.shape == (3, 2, 128, 128)
    media = backbone.decode(torch.randn(3, 2, 128, 128))
    assert media.kind == "audio" and media.data.shape == (3, 1, CLIP_SAMPLES) and media.meta == {"sample_rate": 16000}
    assert float(media.data.abs().max()) <= 1


def test_replayed_log_probs_equal_the_rollouts():
    backbone = tiny_enhancer()
    sampler = FlowSDESampler(FlowSDEOptions())
    prompts = TRAIN[:3]
    conditions = backbone.encode(prompts)
    states, log_probs, sigmas = sample_trajectories(
        backbone,
        sampler,
        conditions,
        initial_generators=sample_generators(0, 0, 0, [0, 1, 2]),
        step_generators=sample_generators(0, 0, 1, [0, 1, 2]),
        num_steps=4,
        guidance_scale=1.0,
    )
    rollout = Rollout(
        prompts=prompts,
        sample_ids=torch.arange(3),
        group_ids=torch.zeros(3, dtype=torch.long),
        conditions=conditions,
        states=states,
        log_probs=log_probs,
        sigmas=sigmas,
    )
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=1.0, step=0)
    for i in range(3):  # the last step to sigma 0 is deterministic
        transition, _ = replay_transition(ctx, rollout, i)
        torch.testing.assert_close(transition.log_prob, log_probs[:, i], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_the_export_enhances_in_a_fresh_process_as_gyremedia_does(tmp_path, lora):
    """The README's plain torch + diffusers loop, run in a process that never imports gyremedia, on the
    exported folder (LoRA merged), gives the waveform gyremedia's own Euler ODE gives from the same noise."""
    backbone = tiny_enhancer(**({"lora": LoraOptions(enabled=True, target_modules=["conv1", "conv2"])} if lora else {}))
    with torch.no_grad():  # move the weights off their initialisation (LoRA's B starts at zero)
        for p in backbone.trainable_module().parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    backbone.save_pretrained(tmp_path / "export")
    prompts = HELDOUT[:2]
    noise = backbone.sample_noise(sample_generators(0, 0, 0, [0, 1]))
    states, _, _ = sample_trajectories(
        backbone,
        EulerODESampler(),
        backbone.encode(prompts),
        initial_generators=sample_generators(0, 0, 0, [0, 1]),
        step_generators=sample_generators(0, 0, 1, [0, 1]),
        num_steps=6,
        guidance_scale=1.0,
    )
    ours = backbone.decode(states[:, -1]).data[:, 0]
    noisy = torch.from_numpy(np.stack([parse_prompt(p).pair()[0] for p in prompts]))
    torch.save({"noisy": noisy, "noise": noise}, tmp_path / "inputs.pt")
    readme = (tmp_path / "export" / "README.md").read_text()
    code = readme.split("```python\n")[1].split("```")[0].replace("THIS_FOLDER", str(tmp_path / "export"))
    script = code + (
        f"\ninputs = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
        "torch.randn = lambda shape, generator=None: inputs['noise']  # the same initial noise\n"
        f"torch.save(enhance(inputs['noisy'], steps=6), {str(tmp_path / 'out.pt')!r})\n"
        "import sys; assert not any(m.startswith('gyremedia') for m in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(theirs, ours, atol=2e-4, rtol=0)


SPEECH_YAML = """
run: {output_dir: RUN_DIR, seed: 0}
backbone:
  name: speech_enhancement
  tiny: {block_out_channels: [8, 16]}
sampler: {name: flow_sde}
objective: {name: grpo}
rewards: [{name: pesq}, {name: estoi}]
advantage: {combine: normalize_each}
monitor: {gold: [{name: si_sdr}]}
data: {prompts_file: TRAIN_FILE}
rollout: {batch_size: 4, group_size: 2, num_steps: 3}
train: {steps: 2}
eval: {prompts_file: HELDOUT_FILE, samples: 4, metric: pesq, grid_size: 2}
checkpoint: {every: 1}
logging: {loggers: [jsonl]}
"""


def speech_config(tmp_path: Path, *overrides: str):
    (tmp_path / "train.txt").write_text("\n".join(TRAIN[:8]))
    (tmp_path / "heldout.txt").write_text("\n".join(HELDOUT[:2]))
    text = (
        SPEECH_YAML.replace("RUN_DIR", str(tmp_path / "run"))
        .replace("TRAIN_FILE", str(tmp_path / "train.txt"))
        .replace("HELDOUT_FILE", str(tmp_path / "heldout.txt"))
    )
    path = tmp_path / "speech.yaml"
    path.write_text(text)
    return resolve_config(load_config(path, list(overrides)), PluginManager())


def test_an_image_reward_fails_at_config_time(tmp_path):
    with pytest.raises(
        ConfigError,
        match="reward 'shapes_verifier' scores image, but backbone 'speech_enhancement' makes "
        "audio: choose one of clap, dnsmos, estoi, pesq, si_sdr",
    ):
        speech_config(tmp_path, "rewards.0.name=shapes_verifier")


@pytest.mark.parametrize("name", ["speech_quickstart", "speech_single_metric"])
def test_the_speech_configs_resolve(name):
    config = resolve_config(load_config(str(bundled_config(f"{name}.yaml")), []), PluginManager())
    assert config.backbone.name == "speech_enhancement" and "dnsmos" in [r.name for r in config.rewards]


def test_the_same_trainer_trains_the_enhancer_and_writes_clips_and_spectrograms(tmp_path, capsys):
    Trainer(speech_config(tmp_path), PluginManager()).train()
    run = tmp_path / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval/pesq" in metrics[0] and "eval/gold/si_sdr" in metrics[0] and "monitor/hacking" in metrics[-1]
    for made in (
        "before.png",
        "after.png",
        "compare.png",
        "before/00.wav",
        "after/01.wav",
        "noisy/00.wav",
        "clean/01.wav",
    ):
        assert (run / "samples" / made).is_file(), made
    wave, rate = read_wav(run / "samples" / "clean" / "00.wav")
    assert rate == 16000 and wave.shape == (1, CLIP_SAMPLES)
    assert (run / "pipeline" / "unet" / "config.json").is_file() and (run / "pipeline" / "stft.json").is_file()
    changes = json.loads((run / "heldout_changes.json").read_text())  # every eval score, paired, by the run itself
    assert {"pesq", "estoi", "gold/si_sdr"} <= set(changes) and changes["pesq"]["samples"] == 4
    assert main(["eval", str(run), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert {"pesq", "estoi", "gold/si_sdr"} <= set(report["differences"])
    assert all(d["ci95_low"] <= d["mean"] <= d["ci95_high"] for d in report["differences"].values())


def test_the_trainer_has_no_audio_specific_code():
    source = (Path(__import__("gyremedia.trainer").trainer.__file__)).read_text().lower()
    assert not any(word in source for word in ("audio", "speech", "wav", "stft", "sample_rate"))


def test_dnsmos_scores_a_batch_in_the_memory_of_a_few_segments():
    """The quickstart's 16 clips once took 1.8 GiB at once (16 segments per network run); one segment per run
    scores the same and peaks at a few hundred MiB. Peak: the kernel's high-water mark, reset just before."""
    import resource

    from gyremedia_speech.rewards import dnsmos

    waves = np.random.default_rng(0).standard_normal((16, CLIP_SAMPLES)).astype(np.float32) * 0.1
    dnsmos(waves[:1])  # the session's first run allocates what every later run reuses
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * resource.getpagesize()
    scores = dnsmos(waves)
    with open("/proc/self/status") as f:
        peak = int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
    assert peak - before < 600 * 2**20, f"{(peak - before) / 2**20:.0f} MiB"
    torch.testing.assert_close(scores["ovrl"], dnsmos(waves, batch_size=16)["ovrl"])
