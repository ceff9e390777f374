"""Make ``assets/speech16``: a tiny flow-matching speech enhancer pretrained on NoisySpeech (CPU, fixed seed).

    python -m gyremedia_speech.pretrain --out assets/speech16 --steps 600

Trains the ``speech_enhancement`` network (a diffusers ``UNet2DModel``) with the rectified-flow loss, on the
clean estimate ``x0 = x_t - t v`` (``t^2 ||v - (eps - x0)||^2``, the weighting DiffusionNFT's loss has), on
(noisy, clean) pairs of the train split: random sentences, voices, rates, pitches, noise kinds and SNRs,
fresh noise every step (none of the RL prompts' noise seeds). Timesteps are uniform. It is stopped early
on purpose, so the enhancer is imperfect and RL has room. The data are not shipped: eSpeak NG (the
``espeakng-loader`` wheel) regenerates every clip from its prompt in about 10 ms.
``pretraining.json`` records the command and the held-out metrics measured at the end (Euler ODE with 10
steps, as the quickstart evaluates), beside the noisy input's own.
Deterministic for a given seed, step count and torch thread count.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from gyremedia.evaluation import nanmean, score
from gyremedia.interfaces import BuildContext
from gyremedia.rollout import Media
from gyremedia.sampling import renoise
from gyremedia_samplers.ode import EulerODESampler
from gyremedia_speech.backbone import (
    SpeechEnhancementBackbone,
    SpeechEnhancementOptions,
    TinyEnhancerOptions,
    noisy_and_clean,
)
from gyremedia_speech.rewards import DNSMOSOptions, DNSMOSReward, ESTOIReward, PESQReward, SISDRReward
from gyremedia_speech.world import (
    HELDOUT_SENTENCES,
    NOISE_KINDS,
    PITCHES,
    RATES,
    SAMPLE_RATE,
    SENTENCES,
    SNR_RANGE,
    TRAIN_VOICES,
    Utterance,
    parse_prompt,
    split_prompts,
)

PRETRAINING_NOISE_SEEDS = 10_000_000  # first noise seed of the pretraining pairs: apart from every RL prompt's


def metrics() -> dict:
    return {
        "pesq": PESQReward(),
        "estoi": ESTOIReward(),
        "dnsmos": DNSMOSReward(DNSMOSOptions()),
        "si_sdr": SISDRReward(),
    }


def evaluate(
    backbone: SpeechEnhancementBackbone, rewards: dict, prompts: list[str], seed: int = 1234
) -> dict[str, float]:
    """Mean metrics of one enhancement per prompt, generated with 10 Euler steps."""
    backbone.transformer.eval()
    media = backbone.generate(prompts, seed=seed, sampler=EulerODESampler(), num_steps=10, guidance_scale=1.0).media
    backbone.transformer.train()
    return {k: nanmean(v) for k, v in score(rewards, media, prompts).items()}


def noisy_baseline(rewards: dict, prompts: list[str]) -> dict[str, float]:
    """The metrics of the unprocessed noisy input: what enhancement starts from."""
    noisy = torch.from_numpy(np.stack([noisy_and_clean(parse_prompt(p))[0] for p in prompts]))[:, None]
    return {
        k: nanmean(v) for k, v in score(rewards, Media("audio", noisy, {"sample_rate": SAMPLE_RATE}), prompts).items()
    }


def random_utterances(count: int, rng: np.random.Generator, first_seed: int) -> list[Utterance]:
    """Train-split utterances (train sentences and voices) with noise seeds from ``first_seed``."""
    sentences = range(len(SENTENCES) - HELDOUT_SENTENCES)
    return [
        Utterance(
            int(rng.choice(sentences)),
            str(rng.choice(TRAIN_VOICES)),
            int(rng.choice(RATES)),
            int(rng.choice(PITCHES)),
            str(rng.choice(NOISE_KINDS)),
            int(rng.integers(SNR_RANGE[0], SNR_RANGE[1] + 1)),
            first_seed + i,
        )
        for i in range(count)
    ]


def pretrain(
    out: Path, steps: int, seed: int, batch: int, lr: float, eval_every: int, eval_prompts: int, snapshots: Path | None
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    train_prompts, heldout_prompts = split_prompts()
    (out / "train_prompts.txt").write_text("\n".join(train_prompts) + "\n")
    (out / "heldout_prompts.txt").write_text("\n".join(heldout_prompts) + "\n")
    rewards = metrics()
    probe = heldout_prompts[:eval_prompts]
    noisy = noisy_baseline(rewards, probe)
    print(json.dumps({"noisy_input": noisy}), flush=True)
    backbone = SpeechEnhancementBackbone(
        SpeechEnhancementOptions(tiny=TinyEnhancerOptions(seed=seed)), BuildContext(device=torch.device("cpu"))
    )
    model = backbone.transformer.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    rng = np.random.default_rng([seed, 16])
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in tqdm(range(1, steps + 1), desc="speech enhancer", mininterval=10):
        utterances = random_utterances(batch, rng, PRETRAINING_NOISE_SEEDS + step * batch)
        noisy_waves, clean_waves = zip(*(u.pair() for u in utterances))
        conditions = {"noisy": backbone.stft.to_spec(torch.from_numpy(np.stack(noisy_waves)))}
        x0 = backbone.stft.to_spec(torch.from_numpy(np.stack(clean_waves)))
        t = torch.rand(batch, generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        xt = renoise(x0, noise, t)
        # the rectified-flow loss on the clean estimate, t^2 ||v - (eps - x0)||^2 (= ||x0^ - x0||^2), as NFT's
        clean = xt - t.view(-1, 1, 1, 1) * backbone.predict(xt, t, conditions)
        loss = torch.nn.functional.mse_loss(clean, x0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % eval_every == 0 or step == steps:
            record = {
                "step": step,
                "minutes": (time.time() - started) / 60,
                "loss": loss.item(),
                "heldout": evaluate(backbone, rewards, probe),
            }
            history.append(record)
            print(json.dumps(record), flush=True)
            if snapshots is not None:
                backbone.save_pretrained(snapshots / f"step-{step:06d}")
    backbone.save_pretrained(out)
    summary = {
        "command": f"python -m gyremedia_speech.pretrain --out {out} --steps {steps} --seed {seed} --batch {batch} "
        f"--lr {lr} --eval-every {eval_every} --eval-prompts {eval_prompts}",
        "seed": seed,
        "steps": steps,
        "minutes": (time.time() - started) / 60,
        "torch_threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "noisy_input": noisy,
        "final": history[-1],
        "history": history,
        "train_prompts": len(train_prompts),
        "heldout_prompts": len(heldout_prompts),
    }
    (out / "pretraining.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--steps", type=int, default=600, help="training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts the evaluations score")
    parser.add_argument("--snapshots", type=Path, default=None, help="also save the model at every evaluation")
    args = parser.parse_args(argv)
    summary = pretrain(
        args.out, args.steps, args.seed, args.batch, args.lr, args.eval_every, args.eval_prompts, args.snapshots
    )
    print(json.dumps(summary["final"], indent=2))


if __name__ == "__main__":
    main()
