"""Real shapes: one rollout and one update of every family at its real grid, sequence, frame and vocabulary sizes.

    python benchmarks/memory.py --real-shapes [--families sd3.5 flux.1 ...] [--json PATH]

Each family's replica is built from the same diffusers / transformers classes as the real model, with the sizes
that grow at their real values (latent grid, image tokens, text tokens, frames, completion length, vocabulary)
and every other width narrow: one block of each kind the architecture has, one or two attention heads of a few
channels, VAEs of 8 channels with the real number of downsamplings (8x; Wan's 4x in time too). Depth and width
only multiply time and the weights' bytes; the shapes are what can make a step's memory explode. Per family, one
step of ``Trainer.train_step`` (a rollout of 2 samples in one group, 2 denoising transitions, Flow-GRPO; DDIM-eta
for the UNet; token GRPO for the LM; fp32, no classifier-free guidance, full fine-tuning, no checkpointing) runs
in its own process, and each component's peak resident memory above the loaded model and its time are taken:
text encoding, the whole rollout (which includes the encoding), decoding, the reward (JPEG size for images and
video; the quickstarts' own rewards for the LM, speech and the world model) and the update.

The families at their real defaults: SD3.5 and FLUX.1/FLUX.2 at 1024 x 1024, Qwen-Image at 1328 x 1328, SD 1.x
at 512 x 512 (cross-attention where SD 1.x has it, over 64 x 64 latents), Wan 2.1 at 480 x 832, the LM at 1,024
completion tokens and a 151,936-token vocabulary, Wan 2.1 at 480 x 832 and 81 frames (21 latent frames, 32,760
tokens).
Speech enhancement and the world model live in worlds whose sizes are fixed by their data (1.27 s utterances at
16 kHz; 16 x 16-pixel frames, 4 per clip), so they run as their quickstarts are, at the quickstarts' batches.

A second, smaller run of each growing family gives the growth exponent of the step's peak: ``log(peak ratio) /
log(size ratio)`` along its axis (image tokens, frames, completion length, vocabulary); 1 is linear, what the
shapes require when attention runs in tiles (SDPA's flash kernel), 2 a tensor quadratic in the tokens.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from memory import MiB, make_probe, rss  # noqa: E402

PROMPTS = ["a red circle left of a blue square", "two green triangles above a yellow circle"]
NARROW_VAE = [8, 8, 8, 8]  # four levels: the real 8x downsampling


@dataclass
class Run:
    """One measured configuration: the family, its growing axis and that axis's size, the config."""

    family: str
    shape: str  # what a reader sees, e.g. "1024 x 1024, 4,096 image tokens + 333 text"
    sizes: dict[str, int]  # what grows -> its size here: image tokens, frames, completion tokens, vocabulary
    config: dict = field(default_factory=dict)
    bundled: str | None = None  # a bundled config the overrides apply to, instead of ``config``
    overrides: list[str] = field(default_factory=list)
    axis: str = ""  # the axis a smaller point varies, for the exponent against the family's real default
    lm_vocabulary: int = 0  # build the LM replica at this vocabulary first


def image_config(backbone: dict, sampler: str = "flow_sde") -> dict:
    """One GRPO step of 2 samples in one group, 2 transitions, rewarded by JPEG size."""
    return {
        "run": {"seed": 0},
        "backbone": backbone,
        "sampler": {"name": sampler},
        "objective": {"name": "grpo"},
        "rewards": [{"name": "jpeg_compressibility"}],
        "data": {"prompts": PROMPTS},
        "rollout": {"batch_size": 2, "group_size": 2, "num_steps": 2, "guidance_scale": 1.0},
        "train": {"steps": 1, "learning_rate": 1.0e-5},
        "checkpoint": {"every": 1000},
        "eval": {"samples": 2, "grid_size": 2, "every": 0},
        "export": {"on_train_end": False},
        "logging": {"loggers": ["jsonl"], "progress": False},
    }


def patched(
    family: str,
    backbone: str,
    pixels: int,
    tiny: dict,
    max_sequence_length: int,
    text_tokens: int,
    axis: str,
    sized: bool = True,
) -> Run:
    """A 2 x 2-patch transformer behind an 8x VAE at ``pixels`` square: its latent grid and image tokens real.
    ``sized``: the backbone takes height and width (else the tiny latent size alone sets them)."""
    latent = pixels // 8
    tokens = (latent // 2) ** 2
    backbone_options = {
        "name": backbone,
        "max_sequence_length": max_sequence_length,
        "tiny": {"latent_size": latent, **tiny},
        **({"height": pixels, "width": pixels} if sized else {}),
    }
    return Run(
        family,
        f"{pixels} x {pixels}, {tokens:,} image tokens + {text_tokens} text",
        {"image tokens": tokens},
        image_config(backbone_options),
        axis=axis,
    )


def sd35(pixels: int, axis: str = "") -> Run:
    tiny = {
        "latent_channels": 16,
        "vae_channels": NARROW_VAE,
        "num_layers": 1,
        "num_attention_heads": 1,
        "attention_head_dim": 64,
        "text_hidden_size": 32,
        "text_layers": 1,
        "text_max_length": 77,
    }
    return patched("SD3.5", "flow_matching", pixels, tiny, 256, 77 + 256, axis, sized=False)


def flux1(pixels: int, axis: str = "") -> Run:
    tiny = {
        "latent_channels": 16,
        "vae_channels": NARROW_VAE,
        "num_layers": 1,
        "num_single_layers": 1,
        "num_attention_heads": 1,
        "attention_head_dim": 16,
        "axes_dims_rope": [4, 6, 6],
        "text_hidden_size": 32,
        "text_layers": 1,
        "text_max_length": 77,
    }
    return patched("FLUX.1", "flux", pixels, tiny, 512, 512, axis)


def flux2(pixels: int, axis: str = "") -> Run:
    tiny = {
        "latent_channels": 32,
        "vae_channels": NARROW_VAE,
        "num_layers": 1,
        "num_single_layers": 1,
        "num_attention_heads": 1,
        "attention_head_dim": 16,
        "axes_dims_rope": [4, 4, 4, 4],
        "text_hidden_size": 16,
    }
    return patched("FLUX.2", "flux2", pixels, tiny, 512, 512, axis)


def qwen_image(pixels: int, axis: str = "") -> Run:
    tiny = {
        "latent_channels": 16,
        "vae_channels": 4,
        "vae_multipliers": [1, 2, 4, 4],
        "num_layers": 1,
        "num_attention_heads": 1,
        "attention_head_dim": 24,
        "text_hidden_size": 16,
        "text_layers": 1,
    }
    return patched("Qwen-Image", "qwen_image", pixels, tiny, 512, 512, axis)


def sd1(pixels: int, axis: str = "") -> Run:
    latent = pixels // 8
    tiny = {
        "latent_size": latent,
        "latent_channels": 4,
        "vae_channels": NARROW_VAE,
        "unet_channels": [8, 8, 8, 8],
        "attention_blocks": "before_last",
        "attention_heads": 1,
        "text_hidden_size": 32,
        "text_layers": 1,
        "text_max_length": 77,
    }
    return Run(
        "SD 1.x UNet",
        f"{pixels} x {pixels}, attention over {latent**2:,} latents + 77 text",
        {"latent positions": latent**2},
        image_config({"name": "diffusion", "tiny": tiny}, sampler="ddim_eta"),
        axis=axis,
    )


def wan(frames: int, axis: str = "") -> Run:
    latent_frames = (frames - 1) // 4 + 1
    tokens = latent_frames * (480 // 16) * (832 // 16)
    tiny = {
        "latent_channels": 16,
        "vae_base_dim": 4,
        "num_layers": 1,
        "num_attention_heads": 1,
        "attention_head_dim": 12,
        "ffn_dim": 32,
        "text_hidden_size": 32,
        "text_layers": 1,
        "text_max_length": 512,
    }
    return Run(
        "Wan 2.1",
        f"480 x 832, {frames} frames, {tokens:,} tokens + 512 text",
        {"frames": frames},
        image_config(
            {"name": "wan", "num_frames": frames, "height": 480, "width": 832, "max_sequence_length": 512, "tiny": tiny}
        ),
        axis=axis,
    )


def lm(tokens: int, vocabulary: int, axis: str = "") -> Run:
    """The llm_quickstart on a 1-layer, 64-wide Llama at ``vocabulary``, 4 rows of ``tokens`` new tokens."""
    return Run(
        "causal LM",
        f"{tokens:,} completion tokens, vocabulary {vocabulary:,}, 4 rows",
        {"completion tokens": tokens, "vocabulary": vocabulary},
        bundled="llm_quickstart",
        overrides=["rollout.batch_size=4", "rollout.group_size=4", f"backbone.max_new_tokens={tokens}"],
        axis=axis,
        lm_vocabulary=vocabulary,
    )


def quickstart(family: str, bundled: str, shape: str) -> Run:
    return Run(family, shape, {}, bundled=bundled, overrides=["train.steps=1"])


#: family -> its runs, the real default first; ``--quick`` keeps the real ones only
FAMILIES = {
    "sd3.5": lambda: [sd35(1024), sd35(512, "image tokens")],
    "flux.1": lambda: [flux1(1024), flux1(512, "image tokens")],
    "flux.2": lambda: [flux2(1024), flux2(512, "image tokens")],
    "qwen-image": lambda: [qwen_image(1328), qwen_image(672, "image tokens")],
    "sd1": lambda: [sd1(512), sd1(256, "latent positions")],
    "wan2.1": lambda: [wan(81), wan(17, "frames")],
    "lm": lambda: [lm(1024, 151_936), lm(256, 151_936, "completion tokens"), lm(1024, 32_000, "vocabulary")],
    "speech": lambda: [
        quickstart(
            "speech enhancement",
            "speech_quickstart",
            "the quickstart: 16 utterances of 1.27 s (2 x 128 x 128 STFT), 10 steps",
        )
    ],
    "world": lambda: [
        quickstart(
            "video world model", "world_model_quickstart", "the quickstart: 32 clips of 4 frames of 16 x 16, 10 steps"
        )
    ],
}


# ---------------------------------------------------------------------------------------------- worker


class NestedMeter:
    """Each wrapped call is a phase with its own peak and time; phases may nest (the rollout encodes text)."""

    def __init__(self, probe) -> None:
        self.probe, self.open, self.phases = probe, [], {}

    def _fold(self) -> None:
        high = self.probe.peak()
        for frame in self.open:
            frame["peak"] = max(frame["peak"], high)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def phase(*args, **kwargs):
            self._fold()
            self.probe.reset()
            frame = {"peak": rss(), "start": time.perf_counter()}
            self.open.append(frame)
            try:
                return original(*args, **kwargs)
            finally:
                self._fold()
                self.open.pop()
                self.probe.reset()
                record = self.phases.setdefault(label, {"peak": 0, "seconds": 0.0, "calls": 0})
                record["peak"] = max(record["peak"], frame["peak"])
                record["seconds"] += time.perf_counter() - frame["start"]
                record["calls"] += 1

        setattr(owner, name, phase)


def measure(spec: dict) -> dict:
    """One run, in this (fresh) process: build the trainer, take the RSS, run one step through the meter."""
    import torch
    import yaml

    from gyremedia.cli import bundled_config
    from gyremedia.config import load_config, resolve_config
    from gyremedia.plugins import PluginManager
    from gyremedia.stages import rollout as rollout_stage
    from gyremedia.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    run = Run(**spec["run"])
    probe, _ = make_probe()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.output_dir={Path(tmp) / 'run'}", *run.overrides]
        if run.lm_vocabulary:
            from token_memory import build_model

            build_model(Path(tmp) / "model", run.lm_vocabulary)
            overrides.append(f"backbone.pretrained={Path(tmp) / 'model'}")
        if run.bundled:
            path = bundled_config(f"{run.bundled}.yaml")
            overrides += [
                "eval.every=0",
                "export.on_train_end=false",
                "checkpoint.every=1000",
                "logging.progress=false",
            ]
        else:
            path = Path(tmp) / "run.yaml"
            path.write_text(yaml.safe_dump(run.config))
        pm = PluginManager()
        trainer = Trainer(resolve_config(load_config(path, overrides), pm), pm)
        state = trainer.setup()
        module = state.backbone.trainable_module()
        meter = NestedMeter(probe)
        if hasattr(state.backbone, "encode"):
            meter.wrap(state.backbone, "encode", "text encoding")
        # the stages: the loop calls the rollout stage's collect() and the others through their hooks
        meter.wrap(rollout_stage, "collect", "rollout")
        meter.wrap(state.backbone, "media", "decode")
        meter.wrap(state.plugins.hook, "gyremedia_score_rollout", "reward")
        meter.wrap(state.plugins.hook, "gyremedia_update", "update")
        meter.wrap(trainer, "train_step", "step")
        gc.collect()
        baseline = rss()
        trainer.train_step(0)
    probe.close()
    phases = {label: {**p, "peak": p["peak"] - baseline} for label, p in meter.phases.items()}
    return {
        "run": asdict(run),
        "params": sum(p.numel() for p in module.parameters()),
        "baseline": baseline,
        "phases": phases,
        "method": probe.method,
    }


# ---------------------------------------------------------------------------------------------- parent


def run_one(run: Run, threads: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    spec = json.dumps({"run": asdict(run), "threads": threads})
    done = subprocess.run(
        [sys.executable, __file__, "--worker", spec], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise RuntimeError(f"{run.family} {run.shape} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / MiB:,.0f} MiB"


PHASES = ["text encoding", "rollout", "decode", "reward", "update"]
GROWING = ["rollout", "decode", "update", "step"]  # the phases an exponent is given for


def exponent(small: dict, large: dict, axis: str, phase: str) -> float:
    """``log(peak ratio) / log(size ratio)`` of one phase between two runs that differ along ``axis``."""
    ratio = large["run"]["sizes"][axis] / small["run"]["sizes"][axis]
    return math.log(large["phases"][phase]["peak"] / small["phases"][phase]["peak"]) / math.log(ratio)


def pairs(results: list[dict]) -> list[tuple[dict, dict]]:
    """(smaller point, the family's real default) for every run that varies one axis."""
    real = {r["run"]["family"]: r for r in results if not r["run"]["axis"]}
    return [(r, real[r["run"]["family"]]) for r in results if r["run"]["axis"] and r["run"]["family"] in real]


def report(results: list[dict]) -> list[str]:
    import torch

    lines = [
        f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, no accelerator; "
        f"fp32; peaks by {results[0]['method']} above the loaded model's RSS, MALLOC_MMAP_THRESHOLD_=65536; "
        "each cell: peak / seconds (the rollout includes the text encoding)",
        "",
        "| family | shape | replica params | " + " | ".join(PHASES) + " | step peak | step time |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
    for r in results:
        cells = [
            f"{gib(r['phases'][p]['peak'])} / {r['phases'][p]['seconds']:.1f} s" if p in r["phases"] else "-"
            for p in PHASES
        ]
        step = r["phases"]["step"]
        lines.append(
            f"| {r['run']['family']} | {r['run']['shape']} | {r['params'] / 1e6:.2f} M | {' | '.join(cells)} "
            f"| {gib(step['peak'])} | {step['seconds']:.1f} s |"
        )
    lines += [
        "",
        "growth exponents of each phase's peak, log(peak ratio) / log(size ratio): 1 grows as the shapes "
        "do, 2 would be a tensor quadratic in them; below 1, a fixed part still dominates",
        "",
        "| family | axis | from | to | " + " | ".join(GROWING) + " |",
        "|---|---|---|---|" + "---|" * len(GROWING),
    ]
    for small, large in pairs(results):
        axis = small["run"]["axis"]
        lines.append(
            f"| {large['run']['family']} | {axis} | {small['run']['sizes'][axis]:,} "
            f"| {large['run']['sizes'][axis]:,} | "
            + " | ".join(f"{exponent(small, large, axis, p):.2f}" for p in GROWING)
            + " |"
        )
    return [
        *lines,
        "",
        "on paper, bf16 training of the real models on an H100's 80 GB (see projection):",
        "",
        *projection(),
    ]


#: Saved activations per sample x token x block x channel, bf16 bytes, from the fits of ``python benchmarks/memory.py
#: --mixed-precision bf16`` (SD3 blocks of widths 192 to 896; docs/benchmarks.md, "Memory"): (mode, checkpointing)
K_BF16 = {("full", False): 63.0, ("full", True): 5.8, ("lora", False): 38.9, ("lora", True): 2.0}
GPU_BYTES, SHARDS = 80e9, 8  # an H100's memory; FSDP2 over one node's GPUs


@dataclass
class Target:
    """A real model on paper: its trained network, the tokens one sample's forward carries, its frozen parts."""

    name: str
    params: float
    blocks: int
    width: int
    tokens: int
    attention_linears: int  # d x d projections LoRA adapts (rank 8 on the attention's q, k, v, out: 16 d each)
    frozen: float  # text encoders and VAE, bf16 on the device unless backbone.text_encoders_on_cpu

    @property
    def adapters(self) -> float:
        return self.attention_linears * 16 * self.width


TARGETS = [
    Target("SD3.5-Medium, 1024^2", 2.5e9, 24, 1536, 4096 + 333, (24 + 13) * 4, 5.6e9),
    Target("FLUX.1-dev, 1024^2", 12e9, 19 + 38, 3072, 4096 + 512, 19 * 4 + 38 * 3, 4.9e9),
    Target("FLUX.2-dev, 1024^2", 32e9, 8 + 48, 6144, 4096 + 512, 8 * 4 + 48 * 3, 24e9),
    Target("Qwen-Image, 1328^2", 20e9, 60, 3072, 6889 + 512, 60 * 8, 8.3e9),
    Target("Wan2.1-T2V-1.3B, 480p 81 frames", 1.3e9, 30, 1536, 32760, 30 * 8, 5.7e9),
    Target("Wan2.1-T2V-14B, 480p 81 frames", 14e9, 40, 5120, 32760, 40 * 8, 5.7e9),
    Target("Qwen2.5-7B, 256 + 1,024 tokens", 7.6e9, 28, 3584, 1280, 28 * 4, 0.0),
]


def projection() -> list[str]:
    """bf16 training (fp32 master weights) of the TARGETS, one sample per micro-step, per GPU.

    Full: 4P weights + 4P gradients + 8P AdamW + 2P autocast copies; LoRA: 2P bf16 base + 16 B per adapter
    parameter. Activations: K_BF16 x tokens x blocks x width; checkpointed, each block keeps its inputs and one is
    recomputed whole. FSDP2 divides the weights and their states by the GPUs (activations stay per GPU)."""
    lines = [
        "| model | mode | weights + states | activations / sample: no ckpt / ckpt | per GPU, 1 GPU: no ckpt / "
        f"ckpt | per GPU, FSDP2 over {SHARDS}: no ckpt / ckpt | frozen parts (bf16) |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in TARGETS:
        for mode in ("full", "lora"):
            fixed = 18 * t.params if mode == "full" else 2 * t.params + 16 * t.adapters
            units = t.tokens * t.width
            acts = [
                K_BF16[(mode, False)] * units * t.blocks,
                (K_BF16[(mode, True)] * t.blocks + K_BF16[(mode, False)]) * units,
            ]

            def cell(total: float) -> str:
                return f"{gib(total)}{'' if total < GPU_BYTES else ' (over 80 GB)'}"

            what = "full" if mode == "full" else f"LoRA r8 ({t.adapters / 1e6:.0f} M)"
            lines.append(
                f"| {t.name} ({t.params / 1e9:g} B) | {what} | {gib(fixed)} | {gib(acts[0])} / {gib(acts[1])} "
                f"| {' / '.join(cell(fixed + a) for a in acts)} "
                f"| {' / '.join(cell(fixed / SHARDS + a) for a in acts)} | {gib(2 * t.frozen)} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="the real defaults only, no growth exponents")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--report", type=Path, nargs="+", help="print the tables of --json files again")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return 0
    if args.report:
        print("\n".join(report([r for path in args.report for r in json.loads(path.read_text())])))
        return 0
    results = []
    for family in args.families:
        for run in FAMILIES[family]():
            if args.quick and run.axis:
                continue
            start = time.perf_counter()
            results.append(run_one(run, args.threads))
            print(
                f"{run.family} {run.shape}: step peak {gib(results[-1]['phases']['step']['peak'])} "
                f"({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            if args.json:  # written as it goes: a long run keeps what it measured
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=1))
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
