"""Export round trip: the stock diffusers pipeline, in a process that never imports gyremedia,
loads what we export and generates exactly what our own sampler generates."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gyremedia.cli import main
from gyremedia.plugins import PluginManager
from gyremedia.runtime.runs import build_backbone, load_trained_weights, run_config
from gyremedia_samplers.ode import EulerODESampler

GENERATE = """
import json, sys
import numpy as np, torch
from diffusers import StableDiffusion3Pipeline
folder, lora, out, prompts, seeds = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
# The plain call: the tiny pipeline is a complete SD3 pipeline, its (silent) T5 included.
pipe = StableDiffusion3Pipeline.from_pretrained(folder)
if lora != "-":
    pipe.load_lora_weights(lora)
size = pipe.transformer.config.sample_size * pipe.vae_scale_factor
images = pipe(prompts, num_inference_steps=3, guidance_scale=1.0, height=size, width=size, max_sequence_length=1,
              generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="pt").images
np.save(out, images.float().numpy())
ours = [m for m in sys.modules if m.split(".")[0] in ("gyremedia", "gyremedia_samplers", "gyremedia_shapes")]
assert not ours, f"the exported pipeline must load without gyremedia, but {ours} were imported"
"""
PROMPTS, SEEDS = ["a red circle", "two green triangles"], [5, 6]


def ours(backbone) -> np.ndarray:
    """The same generation through gyremedia: our backbone with the Euler ODE sampler."""
    from gyremedia.sampling import sample_trajectories

    generators = [torch.Generator().manual_seed(s) for s in SEEDS]
    states, _, _ = sample_trajectories(
        backbone,
        EulerODESampler(),
        backbone.encode(PROMPTS),
        initial_generators=generators,
        step_generators=[],
        num_steps=3,
        guidance_scale=1.0,
    )
    return backbone.decode(states[:, -1]).data.numpy()


def stock(tmp_path, folder, lora="-") -> np.ndarray:
    out = tmp_path / f"stock-{len(list(tmp_path.iterdir()))}.npy"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", GENERATE, str(folder), str(lora), str(out), json.dumps(PROMPTS), json.dumps(SEEDS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return np.load(out)


@pytest.mark.parametrize(
    "lora,compiled",
    [(False, False), (True, False), pytest.param(True, True, marks=pytest.mark.slow)],
    ids=["full", "lora", "lora-compiled"],
)
def test_exported_pipeline_loads_in_stock_diffusers_and_matches_our_samples(tiny_yaml, tmp_path, lora, compiled):
    """Trained with train.compile too: the export at train end merges the adapters of the compiled network."""
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                str(tiny_yaml),
                f"backbone.lora.enabled={lora}",
                "train.learning_rate=0.01",
                "export.on_train_end=true",
                f"train.compile={compiled}",
            ]
        )
        == 0
    )
    pm = PluginManager()
    backbone = build_backbone(run_config(run, [], pm), pm)
    base_images = ours(backbone)
    load_trained_weights(backbone, run)
    expected = ours(backbone)
    assert not np.allclose(expected, base_images, atol=1e-4)  # training changed what the model draws

    np.testing.assert_allclose(stock(tmp_path, run / "pipeline"), expected, atol=2e-4)  # written at train end
    assert main(["export", str(run), str(tmp_path / "merged")]) == 0
    np.testing.assert_allclose(stock(tmp_path, tmp_path / "merged"), expected, atol=2e-4)
    if lora:
        base = tmp_path / "base"
        build_backbone(run_config(run, ["backbone.lora.enabled=false"], pm), pm).pipeline.save_pretrained(base)
        assert main(["export", str(run), str(tmp_path / "adapters"), "--lora-only"]) == 0
        assert (tmp_path / "adapters" / "pytorch_lora_weights.safetensors").is_file()
        np.testing.assert_allclose(stock(tmp_path, base, tmp_path / "adapters"), expected, atol=2e-4)
    else:
        assert main(["export", str(run), str(tmp_path / "adapters"), "--lora-only"]) == 2


def test_an_export_refuses_a_folder_that_holds_files_and_replaces_it_whole_when_told(tiny_yaml, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(tiny_yaml), "train.steps=1"]) == 0
    out = tmp_path / "exported"
    out.mkdir()
    (out / "unet_lora").mkdir()  # a stale file another export left
    assert main(["export", str(run), str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"gyremedia: error: {out} is not empty: export into a new folder, or add --overwrite to replace what it holds"
    )
    assert main(["export", str(run), str(out), "--overwrite"]) == 0
    assert not (out / "unet_lora").exists() and (out / "model_index.json").is_file()
    assert str(out) in (out / "README.md").read_text()  # names where it is, not the folder it was written in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run", "tiny.yaml"]  # nothing left beside it


def test_a_sigterm_during_the_end_of_run_export_lets_it_finish(make_config, monkeypatch, caplog):
    """The signal handler stays through the export: the run ends with a whole pipeline, not killed midway."""
    import logging
    import signal

    from gyremedia.backbones.sd3 import FlowMatchingBackbone
    from gyremedia.trainer import Trainer

    leaked = []
    previous = signal.signal(signal.SIGTERM, lambda *args: leaked.append(args))
    real_save = FlowMatchingBackbone.save_pretrained

    def preempted_midway(self, out_dir, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        real_save(self, out_dir, **kwargs)

    monkeypatch.setattr(FlowMatchingBackbone, "save_pretrained", preempted_midway)
    try:
        with caplog.at_level(logging.WARNING, logger="gyremedia"):
            state = Trainer(make_config("train.steps=1", "export.on_train_end=true"), PluginManager()).train()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not leaked
    assert "SIGTERM received during the end-of-run export: finishing it" in caplog.text
    assert (state.run_dir / "pipeline" / "model_index.json").is_file()
