"""Every diffusers architecture through the whole core, on its tiny random-weight replica: 2 steps of GRPO
(flow_sde; ddim_eta for the variance-preserving diffusion UNets) and of NFT (ode; deterministic DDIM for the
UNet; interrupted after one step and resumed), then the export round trip: the stock pipeline class, in a process that never imports gyremedia, loads the exported folder with no
other argument and generates what our own sampler generates from the trained weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from backbone_checks import ode_samples

from gyremedia.cli import main
from gyremedia.plugins import PluginManager
from gyremedia.runtime.runs import build_backbone, load_trained_weights, run_config
from gyremedia_samplers.ddim import DDIMEtaOptions, DDIMEtaSampler

# backbone name -> the stock pipeline's output field
ARCHITECTURES = {
    "flow_matching": "images",
    "flux": "images",
    "flux2": "images",
    "wan": "frames",
    "qwen_image": "images",
    "diffusion": "images",
    "diffusion_xl": "images",
}
# backbone -> (stochastic sampler for GRPO, deterministic one for NFT and the comparison); default flow_sde, ode
DDIM_SAMPLERS = ("{name: ddim_eta, eta: 1.0}", "{name: ddim_eta, eta: 0.0}")
SAMPLERS = {"diffusion": DDIM_SAMPLERS, "diffusion_xl": DDIM_SAMPLERS}
FLOW_SAMPLERS = ("{name: flow_sde}", "{name: ode}")
STEPS, PROMPTS, SEEDS = 3, ["a red circle", "two green triangles"], [5, 6]

RUN_YAML = """
run: {{output_dir: {run}, seed: 0}}
backbone: {{name: {backbone}}}
sampler: {sampler}
objective: {{name: grpo, clip_range: 0.01}}
rewards: [{{name: jpeg_compressibility}}]
data: {{prompts: [a red circle, a blue square, two green triangles]}}
rollout: {{batch_size: 4, group_size: 2, num_steps: {steps}}}
train: {{steps: 2, learning_rate: 0.01}}
checkpoint: {{every: 1}}
eval: {{samples: 2, grid_size: 2}}
logging: {{loggers: [jsonl], progress: false}}
"""

GENERATE = """
import json, sys
import numpy as np, torch
import diffusers
name, folder, field, out, prompts, seeds, steps, arguments = sys.argv[1:9]
pipe = getattr(diffusers, name).from_pretrained(folder)
output = pipe(prompt=json.loads(prompts), num_inference_steps=int(steps), guidance_scale=1.0, output_type="pt",
              generator=[torch.Generator().manual_seed(s) for s in json.loads(seeds)], **json.loads(arguments))
np.save(out, getattr(output, field).float().numpy())
ours = [m for m in sys.modules if m.split(".")[0].startswith("gyremedia")]
assert not ours, f"the exported pipeline must load without gyremedia, but {ours} were imported"
"""


def ours(backbone) -> np.ndarray:
    """What our Euler ODE sampler (deterministic DDIM for a diffusion UNet) generates for PROMPTS with the
    noise of SEEDS."""
    deterministic = (
        DDIMEtaSampler(DDIMEtaOptions(eta=0.0)) if backbone.prediction == DDIMEtaSampler.prediction else None
    )
    return ode_samples(backbone, PROMPTS, SEEDS, STEPS, 1.0, sampler=deterministic).data.numpy()


def stock(backbone, folder, field: str, out) -> np.ndarray:
    arguments = json.dumps(backbone.generation_arguments())
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            GENERATE,
            backbone.pipeline_class,
            str(folder),
            field,
            str(out),
            json.dumps(PROMPTS),
            json.dumps(SEEDS),
            str(STEPS),
            arguments,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


def train(config, *overrides: str) -> None:
    assert main(["train", str(config), *overrides]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("backbone", list(ARCHITECTURES))
def test_grpo_nft_resume_and_stock_export(tmp_path, backbone):
    grpo, nft = tmp_path / "grpo.yaml", tmp_path / "nft.yaml"
    stochastic, deterministic = SAMPLERS.get(backbone, FLOW_SAMPLERS)
    grpo.write_text(RUN_YAML.format(run=tmp_path / "grpo", backbone=backbone, steps=STEPS, sampler=stochastic))
    nft.write_text(RUN_YAML.format(run=tmp_path / "nft", backbone=backbone, steps=STEPS, sampler=deterministic))
    train(grpo, "export.on_train_end=false")
    grpo_metrics = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in grpo_metrics if "loss" in m] == [1, 2]
    assert all(m["ratio"] == 1.0 for m in grpo_metrics if "loss" in m)  # first update after each rollout

    train(nft, "objective={name: nft}", "train.steps=1", "export.on_train_end=false")
    assert main(["train", "--resume", str(tmp_path / "nft"), "train.steps=2", "export.on_train_end=true"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "nft" / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(1) == 1 and steps[-1] == 2

    pm = PluginManager()
    policy = build_backbone(run_config(tmp_path / "nft", [], pm), pm)
    base = ours(policy)
    load_trained_weights(policy, tmp_path / "nft")
    expected = ours(policy)
    assert not np.allclose(expected, base, atol=1e-4)  # training changed what the model draws
    exported = stock(policy, tmp_path / "nft" / "pipeline", ARCHITECTURES[backbone], tmp_path / "stock.npy")
    np.testing.assert_allclose(exported, expected, atol=2e-4)
