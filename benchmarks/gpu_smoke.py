"""A first GPU run through the core: a few Flow-GRPO steps of every architecture's tiny replica and of an
SD3.5-Medium-sized random-weight transformer, in bf16 with LoRA, on one CUDA device.

    python benchmarks/gpu_smoke.py [--steps 4] [--skip-large]

Prints one JSON line: per run, the first on-policy update's mean importance ratio (exactly 1.0 when replay
reproduces the rollout) and approximate KL (exactly 0), steps per second (rollout, reward and update, over
the steps after the first, which pays for warm-up), peak GPU memory, the transformer's size, and the host's
waits for the GPU in those steps (torch's sync debug mode: synchronising calls per step, and the five lines
that make most of them); also the device, torch and CUDA versions. The runs: the quickstart recipe in fp32 and
under bf16 autocast, then flow_matching / flux / flux2 / wan / qwen_image tiny replicas and the 2.2 B-parameter
SD3.5-Medium-shaped transformer (24 joint blocks of 24 x 64 heads, 512 px) under `train.mixed_precision=bf16`
with LoRA, eager and with `train.compile` (its steps per second against the eager run's are the compiler's gain
on a GPU). Takes a few minutes on a current GPU; it refuses to run without CUDA, since on a CPU it would measure
nothing this script is for (tests/test_device_placement.py covers device placement there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

from gyremedia.cli import bundled_config
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

COMMON = [
    "eval.prompts_file=null",
    "eval.samples=4",
    "eval.grid_size=4",
    "checkpoint.every=1000",
    "export.on_train_end=false",
    "logging.progress=false",
]
BF16_LORA = ["train.mixed_precision=bf16", "backbone.lora.enabled=true"]
TINY = [
    "rollout.batch_size=8",
    "rollout.group_size=4",
    "rewards=[jpeg_compressibility]",
    "data.prompts_file=null",
    "data.prompts=[a red circle, two green triangles]",
    "backbone.pretrained=null",
]
# SD3.5 Medium's transformer shape: 24 joint blocks, 24 heads of 64, 16 latent channels; 64x64 latents = 512 px
SD35_MEDIUM = [
    "backbone.tiny.num_layers=24",
    "backbone.tiny.num_attention_heads=24",
    "backbone.tiny.attention_head_dim=64",
    "backbone.tiny.latent_channels=16",
    "backbone.tiny.latent_size=64",
    "backbone.tiny.vae_channels=[32,64,64,64]",
    "backbone.tiny.text_hidden_size=384",
    "backbone.max_sequence_length=1",
]
RUNS = {
    "quickstart_fp32": [],
    "quickstart_bf16_autocast": ["train.mixed_precision=bf16"],
    "flow_matching_tiny": [*TINY, *BF16_LORA, "backbone.name=flow_matching"],
    "flux_tiny": [*TINY, *BF16_LORA, "backbone={name: flux}"],
    "flux2_tiny": [*TINY, *BF16_LORA, "backbone={name: flux2}"],
    "wan_tiny": [*TINY, *BF16_LORA, "backbone={name: wan}"],
    "qwen_image_tiny": [*TINY, *BF16_LORA, "backbone={name: qwen_image}"],
    "sd35_medium_shape": [
        *TINY,
        *BF16_LORA,
        "backbone.name=flow_matching",
        *SD35_MEDIUM,
        "rollout.batch_size=4",
        "rollout.group_size=2",
    ],
}
RUNS["sd35_medium_shape_compiled"] = [*RUNS["sd35_medium_shape"], "train.compile=true"]
LARGE = {"sd35_medium_shape", "sd35_medium_shape_compiled"}


def count_syncs(trainer: Trainer) -> list[Counter]:
    """Per training step, the CUDA calls that made the host wait for the GPU, by the Python line that called them
    (``torch.cuda.set_sync_debug_mode("warn")`` warns at each); the list fills as ``trainer`` trains. Other warnings
    are shown as usual."""
    per_step: list[Counter] = []
    train_step = trainer.train_step

    def counted(step: int) -> dict[str, float]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                metrics = train_step(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sites = Counter()
        for w in caught:
            if "synchroniz" in str(w.message):
                sites["/".join(Path(w.filename).parts[-2:]) + f":{w.lineno}"] += 1
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        per_step.append(sites)
        return metrics

    trainer.train_step = counted
    return per_step


def run(name: str, overrides: list[str], steps: int, root: Path) -> dict[str, float]:
    """Train the quickstart's Flow-GRPO recipe with ``overrides`` for ``steps`` steps; its figures."""
    pm = PluginManager()
    config = resolve_config(
        load_config(
            bundled_config("quickstart_grpo.yaml"),
            [f"run.output_dir={root / name}", f"train.steps={steps}", *COMMON, *overrides],
        ),
        pm,
    )
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(config, pm)
    syncs = count_syncs(trainer)
    state = trainer.train()
    torch.cuda.synchronize()
    lines = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [m for m in lines if "time/train" in m]
    later = steps_seen[1:] or steps_seen  # the first step pays for warm-up
    seconds = [m["time/rollout"] + m["time/reward"] + m["time/train"] for m in later]
    later_syncs = syncs[1:] or syncs
    return {
        "ratio_first_step": steps_seen[0]["ratio"],
        "approx_kl_first_step": steps_seen[0]["approx_kl"],
        "steps_per_s": len(seconds) / sum(seconds),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
        "transformer_parameters": sum(p.numel() for p in state.backbone.transformer.parameters()),
        "host_syncs_per_step": sum(sum(c.values()) for c in later_syncs) / len(later_syncs),
        "most_syncs": dict(sum(later_syncs, Counter()).most_common(5)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip-large", action="store_true", help="leave out the SD3.5-Medium-sized runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: this smoke test measures a GPU run"}))
        return 1
    figures = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, overrides in RUNS.items():
            if args.skip_large and name in LARGE:
                continue
            try:
                figures[name] = run(name, overrides, args.steps, Path(folder))
            except Exception as exc:  # noqa: BLE001 - report every run, including the ones that fail
                figures[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "steps": args.steps,
                **figures,
            }
        )
    )
    return 0 if all("error" not in f for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
