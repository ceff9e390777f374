"""Cost of each speech metric per second of 16 kHz audio, measured here in one run.

    python benchmarks/speech_metrics.py [--clips 32] [--threads 1]

Scores ``--clips`` held-out NoisySpeech mixtures (1.27 s each) against their clean references with every
speech reward as the trainer calls it (one batch), three times, and prints the median seconds of compute
per second of audio for each, the machine it ran on, and the ratio to the cheapest. DNSMOS scores a
clip shorter than its 9.01 s input by repeating it (as Microsoft's script does), so its cost per second
of *short* audio is about 7x its cost on clips of 9 s or more, which the last column states.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from gyremedia.rollout import Media
from gyremedia_speech.rewards import DNSMOS_INPUT, DNSMOSOptions, DNSMOSReward, ESTOIReward, PESQReward, SISDRReward
from gyremedia_speech.world import CLIP_SAMPLES, SAMPLE_RATE, parse_prompt, split_prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads (OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    _, heldout = split_prompts()
    prompts = [heldout[i % len(heldout)] for i in range(args.clips)]
    noisy = np.stack([parse_prompt(p).pair()[0] for p in prompts])
    media = Media("audio", torch.from_numpy(noisy)[:, None], {"sample_rate": SAMPLE_RATE})
    rewards = {
        "si_sdr": SISDRReward(),
        "estoi": ESTOIReward(),
        "pesq": PESQReward(),
        "dnsmos": DNSMOSReward(DNSMOSOptions()),
    }
    seconds_of_audio = args.clips * CLIP_SAMPLES / SAMPLE_RATE
    costs = {}
    for name, reward in rewards.items():
        reward(media, prompts)  # warm-up (model load, caches)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            reward(media, prompts)
            times.append(time.perf_counter() - start)
        costs[name] = statistics.median(times) / seconds_of_audio
    cheapest = min(costs.values())
    print(
        f"{args.clips} clips of {CLIP_SAMPLES / SAMPLE_RATE:.2f} s, {args.threads} thread(s), {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores"
    )
    repeat = DNSMOS_INPUT / CLIP_SAMPLES
    for name, cost in costs.items():
        note = f"  (about {cost / repeat:.4f} s per s on clips of 9 s or more)" if name == "dnsmos" else ""
        print(f"{name:<8} {cost:.4f} s per second of audio  {cost / cheapest:8.1f}x si_sdr{note}")
    print(json.dumps({"seconds_per_audio_second": costs, "clips": args.clips, "threads": args.threads}))


if __name__ == "__main__":
    main()
