"""The trainer's overhead: the share of a training step spent outside the denoiser's forward and backward.

    python benchmarks/overhead.py [--config configs/quickstart_nft.yaml] [--steps 6] [--warmup 1] [key=value ...]

Builds the run (``Trainer.setup``), runs ``--warmup`` steps, then times ``--steps`` steps of
``Trainer.train_step`` (rollout, decode, rewards, advantages, optimizer; no evaluation, checkpoint or
logging). Inside each step it times:

* ``forward``: every call of the trained module (the SD3 transformer, FLUX's, the UNet...; the old policy
  and EMA weights of NFT/AWM swap into the same module, so their passes count too) and of a frozen
  reference copy of it (a KL term's, in a full fine-tune), by forward hooks;
* ``backward``: from the module's backward pre-hook (the gradient of its output is ready) to the last
  gradient accumulated into its parameters, per ``backward`` call;
* what is outside them: ``decode`` (the backbone's latents to media), ``encode`` (prompts to conditions,
  cached per prompt), ``noise`` (initial noise), ``sampler`` (the sampler's step math, outside the model),
  ``reward`` (waiting for the rewards and computing advantages, ``time/reward``), ``optimizer`` (the AdamW
  step), ``clip`` (gradient norm and clipping), and ``other`` (everything else: the objective's re-noising
  and loss math, metrics, Python).

Prints the hardware, a table of the breakdown and one JSON line ``{"overhead_fraction": ...}`` (the step
time outside forward and backward over the step time). On an accelerator every timed boundary
synchronises it, which slows the step slightly and makes the split exact.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart_nft.yaml"


class StepClock:
    """Accumulates seconds per phase; ``now`` synchronises the accelerator first, so phases are exact."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.backward_start: float | None = None
        self.last_grad: float | None = None

    def now(self) -> float:
        if self.device.type != "cpu":
            torch.accelerator.synchronize()
        return time.perf_counter()

    def timed(self, phase: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function``, its calls on the main thread booked to ``phase`` (a prefetch thread's are hidden)."""

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return function(*args, **kwargs)
            start = self.now()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[phase] += self.now() - start

        return wrapper

    def watch_forward(self, module: torch.nn.Module) -> None:
        """Time the module's forwards."""
        starts: list[float] = []
        module.register_forward_pre_hook(lambda *_: starts.append(self.now()))

        def forward_done(*_):
            self.seconds["forward"] += self.now() - starts.pop()

        module.register_forward_hook(forward_done)

    def watch_module(self, module: torch.nn.Module) -> None:
        """Time the module's forwards, and its backwards from the output's gradient to the last parameter's."""
        self.watch_forward(module)

        def backward_begins(*_):
            if self.backward_start is None:
                self.backward_start = self.now()

        module.register_full_backward_pre_hook(backward_begins)
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(lambda _: setattr(self, "last_grad", self.now()))

    def watch_backward(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``accelerator.backward``: after it returns, book the module's share of it."""

        @functools.wraps(backward)
        def wrapper(*args, **kwargs):
            self.backward_start = self.last_grad = None
            result = backward(*args, **kwargs)
            if self.backward_start is not None and self.last_grad is not None:
                self.seconds["backward"] += self.last_grad - self.backward_start
            return result

        return wrapper


def measure(
    config_path: Path, overrides: list[str], steps: int, warmup: int, out: Path, prefetch: bool = True
) -> dict[str, Any]:
    pm = PluginManager()
    overrides = [
        f"run.output_dir={out}",
        f"train.steps={warmup + steps}",
        "eval.every=0",
        "logging.progress=false",
        "export.on_train_end=false",
        *overrides,
    ]
    trainer = Trainer(resolve_config(load_config(config_path, overrides), pm), pm)
    if trainer.core.train.compile:  # its hooks would be traced into the compiled graph, or break it
        raise SystemExit("overhead.py times the eager model's forwards with hooks: leave train.compile off")
    state = trainer.setup()
    trainer.config.backbone.meta["prefetches"] &= prefetch  # what the backbone declares, or off
    clock = StepClock(trainer.accelerator.device)
    for step in range(warmup):
        trainer.train_step(step)
    trained = state.backbone.trainable_module()
    clock.watch_module(trained)
    for copy in [m for m in vars(state.backbone).values() if isinstance(m, type(trained)) and m is not trained]:
        clock.watch_forward(copy)  # a frozen reference copy of the trained model
    state.backbone.decode = clock.timed("decode", state.backbone.decode)
    state.backbone.encode = clock.timed("encode", state.backbone.encode)
    state.backbone.sample_noise = clock.timed("noise", state.backbone.sample_noise)
    if state.sampler is not None:
        state.sampler.step = clock.timed("sampler", state.sampler.step)
    state.optimizer.step = clock.timed("optimizer", state.optimizer.step)
    trainer.accelerator.clip_grad_norm_ = clock.timed("clip", trainer.accelerator.clip_grad_norm_)
    trainer.accelerator.backward = clock.watch_backward(trainer.accelerator.backward)
    total = 0.0
    for step in range(warmup, warmup + steps):
        start = clock.now()
        metrics = trainer.train_step(step)
        total += clock.now() - start
        clock.seconds["reward"] += metrics["time/reward"]
    seconds = dict(clock.seconds)
    seconds["other"] = total - sum(seconds.values())
    outside = total - seconds["forward"] - seconds["backward"]
    return {
        "overhead_fraction": outside / total,
        "step_seconds": total / steps,
        "steps": steps,
        "shares": {k: v / total for k, v in seconds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=QUICKSTART)
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--no-prefetch",
        action="store_true",
        help="encode each step's prompts when it starts, not in a background thread during the step before",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(open(os.devnull, "w")):
        result = measure(args.config, args.overrides, args.steps, args.warmup, Path(tmp), not args.no_prefetch)
    device = f"{torch.accelerator.current_accelerator()}" if torch.accelerator.is_available() else "no accelerator"
    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {device}"
    )
    print(
        f"{args.config.name} {' '.join(args.overrides)}{' (no prefetch)' if args.no_prefetch else ''}: "
        f"{args.steps} steps after {args.warmup} warm-up, "
        f"{result['step_seconds']:.2f} s per step"
    )
    print("| phase | share of step time |\n|---|---|")
    for phase, share in sorted(result["shares"].items(), key=lambda kv: -kv[1]):
        print(f"| {phase} | {100 * share:.1f}% |")
    print(
        json.dumps(
            {
                "overhead_fraction": round(result["overhead_fraction"], 4),
                "shares": {k: round(v, 4) for k, v in result["shares"].items()},
                "step_seconds": round(result["step_seconds"], 3),
                "config": args.config.name,
                "prefetch": not args.no_prefetch,
                "overrides": args.overrides,
            }
        )
    )


if __name__ == "__main__":
    main()
