"""A differentiable stand-in for the ShapesBench verifier: a small network that predicts its score from pixels.

The verifier reads shapes with rules, so it has no gradient; spatial credit (``objective: spatial_grpo``) needs
one to say where in an image the reward is decided. This network is trained to predict the verifier's partial
credit of an image for a prompt, and serves only that map: the advantage still comes from the verifier.

    python -m gyremedia_shapes.surrogate --out assets/shapes16_surrogate

makes its training data from the quickstart model's own samples (SDE and ODE, on the training prompts) and
from renders paired with their own and with other prompts, all scored by the verifier; trains for a fixed
number of epochs (CPU, fixed seed); and writes ``surrogate.safetensors`` and ``training.json`` (the command,
the duration, and the correlation with the verifier on held-out prompts' model samples).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gyremedia.options import option
from gyremedia.rollout import Media
from gyremedia_shapes.verifier import verify_batch
from gyremedia_shapes.world import (
    CANVAS,
    COLOURS,
    COUNT_WORDS,
    RELATIONS,
    SHAPES,
    record_prompt,
    render_batch,
    split_prompts,
)

WEIGHTS = "surrogate.safetensors"
FEATURES = 3 * len(COLOURS) + 2 * len(SHAPES) + len(COUNT_WORDS) + len(RELATIONS) + 1


def prompt_features(prompts: list[str]) -> torch.Tensor:
    """``[B, FEATURES]`` one-hot fields of each prompt: colour, shape, count, relation (or none), second colour
    and shape (zeros without a relation)."""
    rows = []
    for text in prompts:
        p = record_prompt(text)
        row = np.zeros(FEATURES, dtype=np.float32)
        offset = 0
        for value, choices in (
            (p.colour, list(COLOURS)),
            (p.shape, list(SHAPES)),
            (p.count, list(COUNT_WORDS)),
            (p.relation, [*RELATIONS, None]),
            (p.colour2, list(COLOURS)),
            (p.shape2, list(SHAPES)),
        ):
            if value in choices:
                row[offset + choices.index(value)] = 1
            offset += len(choices)
        rows.append(row)
    return torch.from_numpy(np.stack(rows))


class SurrogateNetwork(nn.Module):
    """Images ``[B, 3, 16, 16]`` (the canvas) in [0, 1] and prompt features to a predicted verifier score in [0, 1]: a
    convolutional trunk modulated by the prompt (FiLM) and a small head."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.SiLU(),
        )
        self.film = nn.Linear(FEATURES, 2 * width)
        self.head = nn.Sequential(
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.SiLU(),
            nn.Flatten(),
            nn.Linear(width * 16, 64),
            nn.SiLU(),
            nn.Linear(64, 1),
        )

    def forward(self, images: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        if images.shape[-2:] != (CANVAS, CANVAS):  # it reads the world's canvas; other sizes are resampled to it
            images = nn.functional.interpolate(images, size=(CANVAS, CANVAS), mode="bilinear", align_corners=False)
        scale, shift = self.film(features).chunk(2, dim=1)
        hidden = self.trunk(images) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return torch.sigmoid(self.head(hidden).squeeze(1))


@dataclass
class SurrogateOptions:
    path: str = option("${asset:shapes16_surrogate}", help="the folder `python -m gyremedia_shapes.surrogate` wrote")


class ShapesSurrogateReward:
    """The surrogate's predicted verifier score; ``input_gradient`` is its gradient with respect to the images."""

    kinds = {"image"}
    differentiable = True

    def __init__(self, options: SurrogateOptions, context=None) -> None:
        from safetensors.torch import load_file

        self.network = SurrogateNetwork()
        self.network.load_state_dict(load_file(str(Path(options.path) / WEIGHTS)))
        self.network.eval().requires_grad_(False)

    def __call__(self, media: Media, prompts: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {"score": self.network(media.data.detach().float().cpu().clamp(0, 1), prompt_features(prompts))}

    def input_gradient(self, media: Media, prompts: list[str]) -> torch.Tensor:
        """``d score / d image`` for every image ``[B, 3, H, W]``, on the images' device."""
        images = media.data.detach().float().cpu().clamp(0, 1).requires_grad_(True)
        with torch.enable_grad():
            self.network(images, prompt_features(prompts)).sum().backward()
        return images.grad.to(media.data.device)


# --------------------------------------------------------------------------- training


def verifier_scores(images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """The verifier's partial credit of ``[N, 3, H, W]`` images for their prompts."""
    results = verify_batch(images.transpose(0, 2, 3, 1), [record_prompt(p) for p in prompts])
    return np.array([np.mean([r[c] for c in record_prompt(p).criteria]) for r, p in zip(results, prompts)])


def model_samples(prompts: list[str], seed: int, stochastic: bool) -> np.ndarray:
    """The quickstart model's samples ``[N, 3, H, W]`` for ``prompts``: with the Flow-GRPO recipe's SDE sampler
    (what its rollouts see), or the ODE (what evaluation and NFT's rollouts see)."""
    from gyremedia.cli import bundled_config
    from gyremedia.config import load_config, resolve_config
    from gyremedia.plugins import PluginManager
    from gyremedia.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        pm = PluginManager()
        overrides = [f"run.output_dir={tmp}", "logging.loggers=[]", "logging.progress=false"]
        config = resolve_config(load_config(bundled_config("quickstart_grpo.yaml"), overrides), pm)
        state = Trainer(config, pm).setup()
        sampler = state.sampler if stochastic else state.eval_sampler
        generated = state.backbone.generate(prompts, seed=seed, sampler=sampler, num_steps=10, guidance_scale=1.0)
    return generated.media.data.float().clamp(0, 1).numpy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument("--samples", type=int, default=3072, help="model samples per sampler (SDE and ODE)")
    parser.add_argument("--renders", type=int, default=6144, help="renders, each scored for its own and another prompt")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.time()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    train, heldout = split_prompts()
    prompts = [train[i] for i in rng.integers(len(train), size=args.samples)]
    images = np.concatenate([model_samples(prompts, args.seed, True), model_samples(prompts, args.seed + 1, False)])
    texts = prompts * 2
    render_prompts = [train[i] for i in rng.integers(len(train), size=args.renders)]
    renders = render_batch(render_prompts, rng)
    others = [train[i] for i in rng.integers(len(train), size=args.renders)]
    images = np.concatenate([images, renders, renders]).astype(np.float32)
    texts = texts + render_prompts + others
    scores = verifier_scores(images, texts).astype(np.float32)
    test_prompts = [heldout[i % len(heldout)] for i in range(256)]
    test_images = model_samples(test_prompts, args.seed + 100, False)
    test_scores = verifier_scores(test_images, test_prompts)

    network = SurrogateNetwork()
    optimizer = torch.optim.AdamW(network.parameters(), lr=2e-3, weight_decay=1e-4)
    x, f, y = torch.from_numpy(images), prompt_features(texts), torch.from_numpy(scores)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x))
        for begin in range(0, len(x), 128):
            rows = order[begin : begin + 128]
            loss = nn.functional.mse_loss(network(x[rows], f[rows]), y[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        predicted = network(torch.from_numpy(test_images), prompt_features(test_prompts)).numpy()
    correlation = float(np.corrcoef(predicted, test_scores)[0, 1])
    args.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(network.state_dict(), str(args.out / WEIGHTS))
    report = {
        "command": "python -m gyremedia_shapes.surrogate " + " ".join(sys.argv[1:] if argv is None else argv),
        "seconds": round(time.time() - start, 1),
        "training_examples": len(x),
        "heldout_correlation_with_verifier": round(correlation, 3),
        "heldout_mean_abs_error": round(float(np.abs(predicted - test_scores).mean()), 3),
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
