"""Peak memory of one training step against model size: full fine-tune vs LoRA, gradient checkpointing on/off.

    python benchmarks/memory.py [--sizes 5M 25M 100M 200M] [--quick] [--modes full lora]
                                [--checkpointing off on] [--steps 3] [--mixed-precision none]
                                [--json PATH] [--report PATH ...]
    python benchmarks/memory.py --real-shapes [...]   # every family at its real shapes: benchmarks/real_shapes.py

``--quick`` runs 5M and 25M only (8 configurations, about 2 minutes on 2 CPU cores); the full set, 16
configurations, takes 4.5 to 11 minutes there, with other jobs on the cores or not.

The flow_matching backbone's SD3 transformer (``SD3Transformer2DModel``, built from ``TinySD3Options``)
scaled in width and depth (64 channels per head, as SD3's): 5M = 3 heads x 4 blocks, 25M = 6 x 5,
100M = 10 x 7, 200M = 14 x 7. Everything else is small and fixed: latent 16 x 16 x 4 (64 image tokens
after the 2 x 2 patches), two 1-layer CLIP encoders of width 32 (16 tokens) and the silent T5 (1 token),
a 2-level VAE of 8 channels, rollout batch 4 in groups of 2, 2 transitions, fp32 (``--mixed-precision
bf16``: ``train.mixed_precision=bf16``, bf16 autocast with fp32 master weights, LoRA's frozen base in bf16).
The objective is Flow-GRPO (``grpo``, ``kl_beta=0``) with its ``flow_sde`` sampler: it keeps no second copy
of any weights (NFT keeps an EMA old policy, a KL term a frozen reference), so the step holds exactly
weights + gradients + AdamW states + activations; each of its 2 transitions is one micro-step (forward,
backward) over the 4 samples, then one AdamW step. The reward is ``jpeg_compressibility`` (no assets).

Each configuration runs in its own subprocess, started with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc
maps every buffer of 64 KiB or more on its own and unmaps it on free: the resident set then follows the
live tensors instead of keeping freed heap. The worker builds the Trainer (``Trainer(config, pm).setup()``),
takes the resident set (RSS) just before the first step as its baseline, and runs ``--steps`` steps through
``Trainer.train_step``. Peaks are the kernel's own high-water mark (``VmHWM`` in /proc/self/status), reset
through ``/proc/self/clear_refs`` at every phase boundary (rollout, decode, reward, each micro-step's
forward and backward, gradient clipping, AdamW step), so each phase's peak is exact, not sampled; a
self-check at start (a 64 MiB tensor must raise the mark by 64 MiB) falls back to sampling /proc/self/statm
every 5 ms in a thread where the reset is refused. Reported per configuration:

* parameters of the transformer (total, trainable) and the analytic parts: weights (their own bytes),
  gradients (trainable x 4), AdamW states (2 x trainable x 4), the last two also measured (the RSS the
  last step's first backward keeps, and the RSS the first AdamW step, which allocates the states, keeps);
* activations: the RSS the largest forward of the loss in the last step leaves behind for its backward
  (saved tensors and the loss graph), measured; in a bf16 full fine-tune without checkpointing it holds
  autocast's bf16 copies of the fp32 weights (2 bytes per parameter), which the fits take out;
* peak: the highest RSS over the steps minus the baseline (the model already loaded, no optimizer state
  yet): the memory training adds to a loaded model, in steady state (the second step holds the AdamW states
  from the first, and its second micro-step's activations meet the first one's gradients); and
  ``peak - grads - AdamW``, the part of it the analytic terms do not explain;
* the phase where the peak occurred and the step time: the fastest step after the first (which warms up;
  the minimum, because other jobs may share the CPU).

Not included: the peak is over the training step only (the transformer, the frozen text encoders and VAE,
torch and the rest of the process are in the baseline; the weights column is the transformer's alone), and
CPU RSS is not GPU memory (no CUDA context, no caching allocator). Prints a markdown table, the least-squares
fits ``peak = a + b * params`` and ``peak - grads - AdamW = a + c * units`` per mode (units = samples x tokens
x blocks x width), the activations per sample x token x block x channel, and the paper extrapolation they give
to bf16 training of SD3.5-Medium and FLUX.1-dev at 1024 x 1024 (exact weights, gradients, AdamW states and
autocast weight copies; activations from the fit: see ``extrapolate``). ``--json`` writes every number;
``--report`` prints the tables of such files again, joined (an fp32 run and a bf16 one: the extrapolation then
uses the bf16 figures, and a bf16 / fp32 activation ratio is printed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 2**20
#: size name -> (attention heads of 64 channels, transformer blocks)
SIZES = {"5M": (3, 4), "25M": (6, 5), "100M": (10, 7), "200M": (14, 7)}
QUICK = ["5M", "25M"]
LATENT, PATCH, TEXT_TOKENS, T5_TOKENS, BATCH, GROUP, TRANSITIONS = 16, 2, 16, 1, 4, 2, 2

CONFIG = """
run: {{output_dir: {run_dir}, seed: 0}}
backbone:
  name: flow_matching
  max_sequence_length: {t5_tokens}
  gradient_checkpointing: {checkpointing}
  lora: {{enabled: {lora}, rank: 8}}
  tiny: {{latent_size: {latent}, vae_channels: [8, 8], num_layers: {layers}, num_attention_heads: {heads},
          attention_head_dim: 64, text_hidden_size: 32, text_layers: 1, text_max_length: {text_tokens}}}
sampler: {{name: flow_sde}}
objective: {{name: grpo, kl_beta: 0.0}}
rewards: [{{name: jpeg_compressibility}}]
data: {{prompts: [a red circle, a blue square, two green triangles, a yellow circle left of a white square]}}
rollout: {{batch_size: {batch}, group_size: {group}, num_steps: {transitions}, guidance_scale: 1.0}}
train: {{steps: {steps}, learning_rate: 1.0e-5{precision}}}
checkpoint: {{every: 1000}}
eval: {{samples: 2, grid_size: 2, every: 0}}
export: {{on_train_end: false}}
logging: {{loggers: [jsonl], progress: false}}
"""

# ---------------------------------------------------------------------------------------------- probes


def rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class HighWater:
    """The kernel's high-water mark of the resident set (VmHWM), reset by writing 5 to /proc/self/clear_refs."""

    method = "VmHWM reset through /proc/self/clear_refs"

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024

    def close(self) -> None:
        pass


class Sampled:
    """The fallback: the highest /proc/self/statm reading of a thread sampling every ``period`` seconds."""

    method = "/proc/self/statm sampled every 5 ms"

    def __init__(self, period: float = 0.005) -> None:
        self._max, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self._max = max(self._max, rss())

    def reset(self) -> None:
        self._max = rss()

    def peak(self) -> int:
        return max(self._max, rss())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def make_probe():
    """VmHWM when the kernel lets it be reset and it sees a 64 MiB tensor come and go; else sampling."""
    import torch

    try:
        probe = HighWater()
        probe.reset()
        before = rss()
        block = torch.ones(64 * MiB // 4)
        del block
        seen = probe.peak() - before
        if abs(seen - 64 * MiB) < 2 * MiB:
            return probe, seen
    except OSError:
        seen = None
    return Sampled(), seen


class PhaseMeter:
    """Wraps the trainer's stages so every call is a phase: its RSS at start and end and its exact peak."""

    def __init__(self, probe) -> None:
        self.probe, self.events, self.step, self._counts = probe, [], -1, {}
        self.gap_peak = 0

    def begin_step(self, step: int) -> None:
        self.step, self._counts = step, {}
        self.probe.reset()

    def end_step(self) -> None:
        self.gap_peak = max(self.gap_peak, self.probe.peak())

    def wrap(self, owner, name: str, label: str, numbered: bool = False) -> None:
        original = getattr(owner, name)

        def phase(*args, **kwargs):
            self.gap_peak = max(self.gap_peak, self.probe.peak())  # between the wrapped stages
            count = self._counts[label] = self._counts.get(label, 0) + 1
            start = rss()
            self.probe.reset()
            try:
                return original(*args, **kwargs)
            finally:
                self.events.append(
                    {
                        "step": self.step,
                        "phase": f"{label} {count}" if numbered else label,
                        "rss_start": start,
                        "rss_end": rss(),
                        "peak": self.probe.peak(),
                    }
                )
                self.probe.reset()

        setattr(owner, name, phase)


# ---------------------------------------------------------------------------------------------- worker


def measure(spec: dict) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    torch.set_num_threads(spec["threads"])
    probe, self_check = make_probe()
    from gyremedia.config import load_config, resolve_config
    from gyremedia.plugins import PluginManager
    from gyremedia.stages import rollout as rollout_stage
    from gyremedia.stages import scoring as scoring_stage
    from gyremedia.trainer import Trainer

    heads, layers = SIZES[spec["size"]]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory.yaml"
        path.write_text(
            CONFIG.format(
                run_dir=Path(tmp) / "run",
                t5_tokens=T5_TOKENS,
                latent=LATENT,
                layers=layers,
                heads=heads,
                text_tokens=TEXT_TOKENS,
                batch=BATCH,
                group=GROUP,
                transitions=TRANSITIONS,
                steps=spec["steps"],
                checkpointing=str(spec["checkpointing"]).lower(),
                lora=str(spec["mode"] == "lora").lower(),
                precision=(", mixed_precision: bf16" if spec.get("mixed_precision") == "bf16" else ""),
            )
        )
        pm = PluginManager()
        trainer = Trainer(resolve_config(load_config(path), pm), pm)
        state = trainer.setup()
        module = state.backbone.trainable_module()
        total = sum(p.numel() for p in module.parameters())
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        trainable_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        pipeline = state.backbone.pipeline
        frozen = [pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3]
        frozen_parts = sum(p.numel() for part in frozen if part is not None for p in part.parameters())
        tokens: dict[str, int] = {}

        def count_tokens(_, args, kwargs):
            hidden, text = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
            if torch.is_grad_enabled():
                tokens.update(
                    batch=hidden.shape[0],
                    image=(hidden.shape[-1] // PATCH) * (hidden.shape[-2] // PATCH),
                    text=text.shape[1],
                )

        module.register_forward_pre_hook(count_tokens, with_kwargs=True)
        meter = PhaseMeter(probe)
        # the stages: the loop calls collect() and start_scoring() from their modules, the scoring stage as a hook
        meter.wrap(rollout_stage, "collect", "rollout")
        meter.wrap(scoring_stage, "start_scoring", "decode")
        meter.wrap(state.plugins.hook, "gyremedia_score_rollout", "reward")
        meter.wrap(state.objective, "loss", "forward", numbered=True)
        meter.wrap(trainer.accelerator, "backward", "backward", numbered=True)
        meter.wrap(trainer.accelerator, "clip_grad_norm_", "clip")
        meter.wrap(state.optimizer, "step", "AdamW step")

        gc.collect()
        baseline = rss()
        seconds, metrics = [], []
        for step in range(spec["steps"]):
            meter.begin_step(step)
            start = time.perf_counter()
            metrics.append(trainer.train_step(step))
            seconds.append(time.perf_counter() - start)
            meter.end_step()
            state.step = step + 1
    probe.close()

    events = meter.events
    # AdamW allocates its states in the first step; the last step (warm: its first calls are behind it) gives
    # the gradients and the activations
    first = [e for e in events if e["step"] == 0]
    last = [e for e in events if e["step"] == spec["steps"] - 1]
    forwards = [e for e in last if e["phase"].startswith("forward")]
    top = max(events, key=lambda e: e["peak"])
    peak = max(top["peak"], meter.gap_peak)
    backward_1 = next(e for e in last if e["phase"] == "backward 1")
    forward_1 = next(e for e in last if e["phase"] == "forward 1")
    adam_step = next(e for e in first if e["phase"] == "AdamW step")
    # what the process kept beyond the AdamW states after its first step: first-call caches, autograd threads
    after_first = next((e["rss_start"] for e in events if e["step"] == 1), None)
    return {
        **spec,
        "heads": heads,
        "layers": layers,
        "width": heads * 64,
        "params": total,
        "trainable": trainable,
        "frozen_parts_params": frozen_parts,
        "tokens": tokens,
        "micro_steps": len(forwards),
        "weights_bytes": weight_bytes,
        "grads_bytes": trainable_bytes,
        "adamw_bytes": 2 * trainable_bytes,
        # what the last step's first backward left (activations freed, gradients kept); what the first AdamW step kept
        "grads_measured": backward_1["rss_end"] - forward_1["rss_start"],
        "adamw_measured": adam_step["rss_end"] - adam_step["rss_start"],
        "activations": max(e["rss_end"] - e["rss_start"] for e in forwards),
        "first_step_growth": (
            None if after_first is None else after_first - baseline - (adam_step["rss_end"] - adam_step["rss_start"])
        ),
        "baseline_rss": baseline,
        "peak_rss": peak,
        "peak": peak - baseline,
        "peak_phase": f"step {top['step'] + 1} {top['phase']}" if top["peak"] >= meter.gap_peak else "between stages",
        "step_seconds": seconds,
        "grad_norm": [m.get("grad_norm") for m in metrics],
        "method": probe.method,
        "self_check": self_check,
        "events": [{**e, **{k: e[k] - baseline for k in ("rss_start", "rss_end", "peak")}} for e in events],
    }


# ---------------------------------------------------------------------------------------------- parent


def run_one(spec: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares ``y = a + b x``; returns a, b and R^2 (b = 0 with one point)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / ss if ss else 1.0
    return a, b, r2


def mb(value: float) -> str:
    return f"{value / MiB:,.0f}" if abs(value) >= 10 * MiB else f"{value / MiB:,.1f}"


def label(r: dict) -> str:
    bf16 = " bf16" if r.get("mixed_precision") == "bf16" else ""
    return f"{r['mode']}{' + ckpt' if r['checkpointing'] else ''}{bf16}"


def step_time(r: dict) -> float:
    """The fastest step after the first (the only one with ``--steps 1``)."""
    return min(r["step_seconds"][1:] or r["step_seconds"])


def units(r: dict) -> int:
    """Samples x tokens x blocks x channels of the trained forward: what activations scale with."""
    t = r["tokens"]
    return t["batch"] * (t["image"] + t["text"]) * r["layers"] * r["width"]


def is_bf16(r: dict) -> bool:
    return r.get("mixed_precision") == "bf16"


def weight_copies(r: dict) -> int:
    """Bytes of the bf16 copies autocast makes of fp32 trained weights (a full fine-tune under bf16): cached
    for the whole forward, and without checkpointing saved for the backward, so they count among the
    activations the forward leaves. LoRA's frozen base is bf16 already; its fp32 adapters are negligible."""
    return 2 * r["trainable"] if is_bf16(r) and r["mode"] == "full" else 0


def net_activations(r: dict) -> int:
    """The activations a forward leaves, less the weight copies among them."""
    return r["activations"] - (0 if r["checkpointing"] else weight_copies(r))


def overshoot(r: dict) -> float:
    """What the last backward of the last step adds above the RSS it starts from (its gradients already
    exist), per sample x token x channel, in bytes: the backward's transients (with checkpointing, the block
    being recomputed, whole). It holds weight-sized temporaries too, so it overstates at few tokens."""
    last = [e for e in r["events"] if e["step"] == r["steps"] - 1 and e["phase"].startswith("backward")][-1]
    return (last["peak"] - last["rss_start"]) / (units(r) / r["layers"])


def activation_fits(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode: net activations = a + k * units (least squares), and the largest backward overshoot."""
    fits = {}
    for key in dict.fromkeys(label(r) for r in results):
        rows = [r for r in results if label(r) == key]
        xs, ys = [units(r) for r in rows], [net_activations(r) for r in rows]
        # one model size: through the origin (activations vanish with the tokens)
        a, k, r2 = fit(xs, ys) if len(set(xs)) > 1 else (0.0, ys[0] / xs[0], float("nan"))
        fits[key] = {"a": a, "k": k, "r2": r2, "overshoot": max(overshoot(r) for r in rows), "bf16": is_bf16(rows[0])}
    return fits


#: target -> (transformer params, blocks, width, tokens of a 1024 x 1024 image and its prompt, LoRA adapter params)
TARGETS = {
    # 24 MMDiT-X blocks, 1536 wide (24 heads x 64); 4096 image tokens (128 x 128 latent, 2 x 2 patches) + 77 CLIP
    # + 256 T5. LoRA rank 8 on to_q/to_k/to_v/to_out.0: the 24 joint attentions and the 13 extra image
    # self-attentions (attn2), 4 layers of 8 x (1536 + 1536) parameters each.
    "SD3.5-Medium": (2.5e9, 24, 1536, 4096 + 333, (24 + 13) * 4 * 8 * 2 * 1536),
    # 19 double-stream blocks + 38 single-stream blocks, 3072 wide (24 heads x 128); 4096 image tokens + 512 T5.
    # Each token goes through one stream (attention + 4x MLP) in either kind of block, so both count as one
    # block per token. LoRA on the double blocks' to_q/to_k/to_v/to_out.0 and the single blocks' to_q/to_k/to_v.
    "FLUX.1-dev": (12e9, 19 + 38, 3072, 4096 + 512, (19 * 4 + 38 * 3) * 8 * 2 * 3072),
}


def gib(value: float) -> str:
    return f"{value / 2**30:,.1f} GiB" if value >= 2**30 else f"{value / MiB:,.0f} MiB"


def extrapolate(results: list[dict]) -> list[str]:
    """bf16 training (train.mixed_precision=bf16) of the TARGETS at 1024 x 1024, one sample per micro-step.

    Exact: weights (full: fp32 master weights; LoRA: bf16 base + fp32 adapters), fp32 gradients and AdamW
    states of what trains, autocast's bf16 weight copies (full only, 2 bytes per parameter; at the peak with
    checkpointing or without). Activations: the fitted bytes per sample x token x block x channel (measured
    in bf16 when the results hold bf16 runs, else the fp32 figure halved) times the target's tokens x blocks
    x width; with checkpointing each block keeps its inputs and one block is recomputed whole in the
    backward: k_ckpt x blocks + k (one block)."""
    fits = activation_fits(results)
    measured_bf16 = any(f["bf16"] for f in fits.values())
    suffix, scale = (" bf16", 1.0) if measured_bf16 else ("", 0.5)
    source = "measured in bf16" if measured_bf16 else "the fp32 measurement halved"
    lines = [
        f"| model | mode | weights | grads | AdamW | bf16 weight copies | activations per sample ({source}): "
        "no ckpt / ckpt | total, 1 sample: no ckpt / ckpt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, (params, blocks, width, tokens, adapters) in TARGETS.items():
        for mode in ("full", "lora"):
            weights = 4 * params if mode == "full" else 2 * params + 4 * adapters
            trainable = params if mode == "full" else adapters
            grads, adamw, copies = 4 * trainable, 8 * trainable, 2 * params if mode == "full" else 0
            plain, ckpt = fits.get(mode + suffix), fits.get(mode + " + ckpt" + suffix)
            acts = [
                plain["k"] * blocks * tokens * width * scale if plain else None,
                (ckpt["k"] * blocks + plain["k"]) * tokens * width * scale if plain and ckpt else None,
            ]
            fixed = weights + grads + adamw + copies
            what = mode if mode == "full" else f"lora r8 ({adapters / 1e6:.1f} M)"
            lines.append(
                f"| {name} ({params / 1e9:g} B) | {what} | {gib(weights)} | {gib(grads)} | {gib(adamw)} "
                f"| {gib(copies) if copies else '-'} | {' / '.join(gib(a) if a else 'n/a' for a in acts)} "
                f"| {' / '.join(gib(fixed + a) if a else 'n/a' for a in acts)} |"
            )
    return lines


def report(results: list[dict]) -> list[str]:
    import torch

    precisions = sorted({"bf16 autocast" if is_bf16(r) else "fp32" for r in results})
    lines = [
        f"hardware: {platform.machine()}, {os.cpu_count()} CPU cores ({platform.processor() or 'cpu'}), torch "
        f"{torch.__version__} ({results[0]['threads']} threads), no accelerator; {' and '.join(precisions)}; "
        f"peaks by {results[0]['method']}, glibc MALLOC_MMAP_THRESHOLD_=65536",
        f"per step: rollout of {BATCH} samples (groups of {GROUP}), {TRANSITIONS} flow_sde transitions, "
        f"{results[0]['micro_steps']} GRPO micro-steps of forward + backward over {results[0]['tokens']['batch']} "
        f"samples x {results[0]['tokens']['image']} image + {results[0]['tokens']['text']} text tokens, "
        f"one AdamW step; figures in MiB; peak = highest RSS over {results[0]['steps']} steps - RSS before the "
        "first; step time = the fastest step after the first",
        "",
        "| transformer | mode | params | trainable | weights | grads | AdamW | activations | peak "
        "| peak - grads - AdamW | peak at | step time |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['size']} ({r['heads']}x64 wide, {r['layers']} blocks) | {label(r)} | {r['params'] / 1e6:.1f} M "
            f"| {r['trainable'] / 1e6:.2f} M | {mb(r['weights_bytes'])} | {mb(r['grads_bytes'])} "
            f"| {mb(r['adamw_bytes'])} "
            f"| {mb(r['activations'])} | {mb(r['peak'])} | {mb(r['peak'] - r['grads_bytes'] - r['adamw_bytes'])} "
            f"| {r['peak_phase']} | {step_time(r):.2f} s |"
        )
    ratios = [
        (f"{r['size']} {label(r)}", r["grads_measured"] / r["grads_bytes"], r["adamw_measured"] / r["adamw_bytes"])
        for r in results
        if r["mode"] == "full"
    ]
    if ratios:
        lines += [
            "",
            "check, measured / analytic gradients and AdamW states: "
            + ", ".join(f"{name} {g:.3f} / {a:.3f}" for name, g, a in ratios),
        ]
    fp32 = {(r["size"], r["mode"], r["checkpointing"]): r for r in results if not is_bf16(r)}
    pairs = [
        (r, fp32[(r["size"], r["mode"], r["checkpointing"])])
        for r in results
        if is_bf16(r) and (r["size"], r["mode"], r["checkpointing"]) in fp32
    ]
    if pairs:
        lines += [
            "",
            "check, bf16 / fp32 activations (less the bf16 weight copies): "
            + ", ".join(f"{r['size']} {label(r)} {net_activations(r) / f['activations']:.2f}" for r, f in pairs),
        ]
    fits = activation_fits(results)
    lines += [
        "",
        "units = samples x tokens x blocks x width of the trained forward; net activations = activations "
        "less, for a full fine-tune in bf16 without checkpointing, the 2 x trainable bytes of autocast's "
        "weight copies saved for the backward",
        "",
        "| mode | peak = a + b x params | R^2 | peak - grads - AdamW = a + c x units | R^2 "
        "| net activations = a + k x units | R^2 | backward on top, per sample x token x channel |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys(label(r) for r in results):
        rows = [r for r in results if label(r) == key]
        a, b, r2 = fit([r["params"] for r in rows], [r["peak"] for r in rows])
        a2, c, r22 = fit([units(r) for r in rows], [r["peak"] - r["grads_bytes"] - r["adamw_bytes"] for r in rows])
        f = fits[key]
        size, kind = (2, "bf16") if f["bf16"] else (4, "fp32")
        lines.append(
            f"| {key} | {a / MiB:,.0f} MiB + {b:.2f} B x params | {r2:.4f} | {a2 / MiB:,.0f} MiB + {c:.1f} B "
            f"x units | {r22:.4f} | {f['a'] / MiB:,.1f} MiB + {f['k']:.1f} B x units (= {f['k'] / size:.1f} "
            f"{kind} values) | {f['r2']:.4f} | up to {f['overshoot']:.0f} B |"
        )
    lines += [
        "",
        "paper extrapolation, bf16 training at 1024 x 1024 (see docs/benchmarks.md for the assumptions):",
        *extrapolate(results),
    ]
    return lines


def main() -> int:
    if "--real-shapes" in sys.argv[1:]:  # its own options: benchmarks/real_shapes.py
        import real_shapes

        return real_shapes.main([a for a in sys.argv[1:] if a != "--real-shapes"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--quick", action="store_true", help=f"only {' and '.join(QUICK)} (under ~2 minutes)")
    parser.add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument(
        "--steps",
        type=int,
        default=3,
        help="steps per configuration (peak over all; time: the fastest after the first)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument(
        "--mixed-precision",
        choices=["none", "bf16"],
        default="none",
        help="train.mixed_precision (bf16: autocast, fp32 master weights, LoRA's base in bf16)",
    )
    parser.add_argument("--json", type=Path, help="write every figure (and each phase's RSS) here")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        help="print the tables of --json files again (their runs joined), measuring nothing",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return 0
    if args.report:
        print("\n".join(report([r for path in args.report for r in json.loads(path.read_text())])))
        return 0
    sizes = QUICK if args.quick else args.sizes
    results = []
    for size in sizes:
        for mode in args.modes:
            for ckpt in args.checkpointing:
                spec = {
                    "size": size,
                    "mode": mode,
                    "checkpointing": ckpt == "on",
                    "steps": args.steps,
                    "threads": args.threads,
                    "mixed_precision": args.mixed_precision,
                }
                start = time.perf_counter()
                results.append(run_one(spec))
                print(
                    f"{size} {mode} checkpointing {ckpt}: peak {results[-1]['peak'] / MiB:,.0f} MiB "
                    f"({time.perf_counter() - start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    print("\n".join(report(results)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
