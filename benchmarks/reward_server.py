"""What serving a reward costs: one batch scored in-process and through ``gyremedia serve-reward`` on loopback.

The media cross the wire as float32, bit for bit (the lossless contract), so the cost grows with the pixels: a
batch of 64 images of 512 x 512 is 201 MB each way in. Prints the seconds per batch (median of ``--repeats``) of
the reward in-process and through the server, the difference (the serving overhead), the bytes sent, and the peak
resident memory of this process (the client: the batch, its encoding, the answer) and of the server process.

    python benchmarks/reward_server.py [--reward jpeg_compressibility] [--batch 64] [--size 512]
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

from gyremedia.config import select_component
from gyremedia.interfaces import BuildContext
from gyremedia.plugins import PluginManager
from gyremedia.reward_server import encode_batch
from gyremedia.rollout import Media
from gyremedia.scoring import call_reward


def seconds(score, media: Media, prompts: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        score(media, prompts)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def peak_mb(status: str | None = None) -> float:
    """Peak resident memory in MB: of a process by its /proc status file (VmHWM), or of this one."""
    if status is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kilobytes = next(line.split()[1] for line in open(status) if line.startswith("VmHWM:"))
    return int(kilobytes) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", default="jpeg_compressibility")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pm = PluginManager()
    cpu = BuildContext(device=torch.device("cpu"))
    local = pm.build(select_component(pm, "reward", {"name": args.reward}, "reward"), cpu)
    media = Media("image", torch.rand(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0)))
    prompts = [f"prompt {i}" for i in range(args.batch)]
    server = subprocess.Popen(
        [sys.executable, "-m", "gyremedia.cli", "serve-reward", args.reward, "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = server.stdout.readline().split(" on ")[1].strip()
        remote = pm.build(select_component(pm, "reward", {"name": "remote", "url": url}, "reward"), cpu)
        call_reward(remote, media, prompts)  # the first call also checks what the server serves
        in_process = seconds(lambda m, p: call_reward(local, m, p), media, prompts, args.repeats)
        served = seconds(lambda m, p: call_reward(remote, m, p), media, prompts, args.repeats)
        server_peak = peak_mb(f"/proc/{server.pid}/status")
    finally:
        server.kill()
    megabytes = len(encode_batch(media, prompts)) / 1e6
    print(
        f"{args.reward}, {args.batch} images of {args.size} x {args.size}, {platform.processor() or platform.machine()}"
        f", {torch.get_num_threads()} threads"
    )
    print(
        f"| in-process | served (loopback) | overhead | sent per batch | peak RSS client / server |\n"
        f"|---|---|---|---|---|\n| {in_process:.3f} s | {served:.3f} s | {served - in_process:+.3f} s | "
        f"{megabytes:.0f} MB | {peak_mb():.0f} / {server_peak:.0f} MB |"
    )


if __name__ == "__main__":
    main()
