"""The full-scale recipes (configs/sd35m_geneval.yaml, sd35m_ocr, sd35m_pickscore, flux_pickscore_hps,
wan_video_remote) check as a user runs them: `gyremedia config RECIPE.yaml` in a fresh process, from a folder that
holds the prompt sets in Flow-GRPO's layout (dataset/geneval/*_metadata.jsonl, dataset/ocr/*.txt, ...) and the
HPS checkpoint, with only the hub ids pointed at tiny stock folders built offline (CI runs with HF_HUB_OFFLINE=1,
where a hub id that is not cached fails the check). The resolved config must show each recipe's own values
(Flow-GRPO's, as the yamls' headers map them), so a recipe that drifts from them fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch
import yaml

from cli_runs import gyremedia
from gyremedia.plugins import PluginError
from tiny_clip import save_tiny_clip

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

SD3_LORA_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]
WAN_LORA_TARGETS = ["add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v"]

GENEVAL_RECORDS = [
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
    {
        "tag": "counting",
        "include": [{"class": "cup", "count": 2}],
        "exclude": [{"class": "cup", "count": 3}],
        "prompt": "a photo of two cups",
    },
    {
        "tag": "color_attr",
        "include": [{"class": "car", "count": 1, "color": "red"}, {"class": "bench", "count": 1, "color": "blue"}],
        "prompt": "a photo of a red car and a blue bench",
    },
    {
        "tag": "position",
        "include": [{"class": "cat", "count": 1}, {"class": "chair", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a chair left of a cat",
    },
]
PROMPT_SETS = {
    "ocr": [
        'A shop sign that says "OPEN"',
        'A birthday cake with "Happy 30th" written in icing',
        'A road sign reading "SLOW DOWN"',
    ],
    "pickscore": [
        "a watercolor fox in the snow",
        "a neon city street at night, digital art",
        "an astronaut riding a horse",
    ],
    "video": ["a dog running on the beach", "waves crashing on rocks at sunset", "a paper boat drifting on a river"],
}


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    """A folder as a user runs the recipes from: Flow-GRPO's prompt-set layout and the HPS checkpoint file."""
    root = tmp_path_factory.mktemp("recipes_cwd")
    geneval = root / "dataset" / "geneval"
    geneval.mkdir(parents=True)
    lines = "".join(json.dumps(record) + "\n" for record in GENEVAL_RECORDS)
    (geneval / "train_metadata.jsonl").write_text(lines)
    (geneval / "test_metadata.jsonl").write_text(lines * 4)  # Flow-GRPO's test file repeats each prompt 4 times
    for name, prompts in PROMPT_SETS.items():
        folder = root / "dataset" / name
        folder.mkdir(parents=True)
        (folder / "train.txt").write_text("\n".join(prompts) + "\n")
        (folder / "test.txt").write_text("\n".join(prompts[:2]) + "\n")
    # the config checks that the checkpoint exists; building the reward (not done here) would load it
    torch.save({"state_dict": {}}, root / "HPS_v2.1_compressed.pt")
    return root


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny stock folders in place of the hub ids: SD3, FLUX.1 and Wan pipelines, a CLIP model with its processor
    (PickScore's classes), and a Mask2Former config folder for the GenEval detector."""
    from transformers import Mask2FormerConfig

    from gyremedia.backbones.wan import TinyWanOptions, build_tiny_wan_pipeline
    from gyremedia.tiny.flux import TinyFluxOptions, build_tiny_flux_pipeline
    from gyremedia.tiny.sd3 import TinySD3Options, build_tiny_sd3_pipeline

    root = tmp_path_factory.mktemp("tiny_models")
    folders = {name: root / name for name in ("sd3", "flux", "wan", "clip", "detector")}
    build_tiny_sd3_pipeline(TinySD3Options(num_layers=1, text_layers=1)).save_pretrained(folders["sd3"])
    build_tiny_flux_pipeline(TinyFluxOptions()).save_pretrained(folders["flux"])
    build_tiny_wan_pipeline(TinyWanOptions(num_layers=1)).save_pretrained(folders["wan"])
    save_tiny_clip(folders["clip"], ["a", "photo", "of", "dog"])
    Mask2FormerConfig().save_pretrained(folders["detector"])
    return folders


def recipe_overrides(models: dict[str, Path]) -> dict[str, list[str]]:
    """Each recipe's overrides: its hub ids pointed at the tiny folders, nothing else."""
    sd3, clip = f"backbone.pretrained={models['sd3']}", models["clip"]
    pickscore = [f"rewards.0.model={clip}", f"rewards.0.processor={clip}"]
    return {
        "sd35m_geneval": [sd3, f"rewards.0.detector={models['detector']}"],
        "sd35m_ocr": [sd3],
        "sd35m_pickscore": [sd3, *pickscore],
        "flux_pickscore_hps": [f"backbone.pretrained={models['flux']}", *pickscore],
        "wan_video_remote": [f"backbone.pretrained={models['wan']}"],
    }


@pytest.fixture(scope="module")
def checked(user_folder, tiny_models, plugin_manager) -> dict[str, Future]:
    """`gyremedia config configs/RECIPE.yaml OVERRIDES` of every recipe, each in its own process as a user runs it,
    from ``user_folder`` (the recipes' prompt paths are relative to the working directory, as Flow-GRPO's are),
    offline; run side by side (they are independent), each test reading its own."""
    runs = recipe_overrides(tiny_models)
    try:
        plugin_manager.component("reward", "geneval")
    except PluginError:
        del runs["sd35m_geneval"]  # its test skips
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cwd = Path.cwd()
    os.chdir(user_folder)  # every process starts here (and none is started after the chdir back)
    try:
        with ThreadPoolExecutor(len(runs)) as pool:
            futures = {
                recipe: pool.submit(
                    gyremedia, "config", str(CONFIGS / f"{recipe}.yaml"), *overrides, timeout=120, env=env
                )
                for recipe, overrides in runs.items()
            }
            wait(futures.values())
    finally:
        os.chdir(cwd)
    return futures


def resolved_config(checked: dict[str, Future], recipe: str) -> dict:
    """The resolved config `gyremedia config` printed for ``recipe`` (its failure, re-raised, if it failed)."""
    return yaml.safe_load(checked[recipe].result().stdout)


def flow_grpo_core(
    resolved: dict,
    *,
    noise_level: float,
    clip_range: float,
    num_steps: int,
    eval_steps: int,
    guidance: float,
    batch: int,
    group: int,
    learning_rate: float,
) -> None:
    """What every recipe takes from Flow-GRPO: its SDE, the clipped ratio on the first 99% of the transitions, the
    rollout's shape, two optimizer steps per rollout, ODE evaluation."""
    assert resolved["sampler"] == {"name": "flow_sde", "noise_level": noise_level}
    objective = resolved["objective"]
    assert objective["name"] == "grpo"
    assert (objective["clip_range"], objective["adv_clip_max"]) == (clip_range, 5.0)
    assert (objective["transition_selection"], objective["timestep_fraction"]) == ("first", 0.99)
    rollout = resolved["rollout"]
    assert (rollout["batch_size"], rollout["group_size"], rollout["num_steps"]) == (batch, group, num_steps)
    assert rollout["guidance_scale"] == guidance
    train = resolved["train"]
    assert (train["learning_rate"], train["num_minibatches"], train["mixed_precision"]) == (learning_rate, 2, "bf16")
    assert resolved["eval"]["num_steps"] == eval_steps
    assert resolved["eval"]["sampler"]["name"] == "ode"
    assert resolved["backbone"]["lora"]["enabled"] is True
    assert resolved["backbone"]["gradient_checkpointing"] is True


def sd35m_common(resolved: dict, tiny: Path, kl: float) -> None:
    """The three SD3.5-M recipes share Flow-GRPO's SD3 settings; they differ in the reward, prompts and KL."""
    flow_grpo_core(
        resolved,
        noise_level=0.7,
        clip_range=1e-4,
        num_steps=10,
        eval_steps=40,
        guidance=4.5,
        batch=1152,
        group=24,
        learning_rate=3e-4,
    )
    backbone = resolved["backbone"]
    assert (backbone["name"], backbone["pretrained"]) == ("flow_matching", str(tiny))
    assert (backbone["height"], backbone["width"], backbone["max_sequence_length"]) == (512, 512, 128)
    assert (backbone["lora"]["rank"], backbone["lora"]["alpha"]) == (32, 64.0)
    assert sorted(backbone["lora"]["target_modules"]) == sorted(SD3_LORA_TARGETS)
    assert resolved["objective"]["skip_zero_advantage"] is True
    assert resolved["advantage"]["std"] == "global"
    assert [(r["name"], r["weight"], r["scale"]) for r in resolved["regularizers"]] == [
        ("gaussian_kl", kl, "flow_grpo")
    ]
    assert (resolved["eval"]["every"], resolved["checkpoint"]["every"], resolved["run"]["seed"]) == (60, 60, 42)


def test_sd35m_geneval(checked, tiny_models):
    if "sd35m_geneval" not in checked:
        pytest.skip(
            "the geneval reward (plugins/gyremedia_rewards/geneval.py) is not registered yet: "
            "configs/sd35m_geneval.yaml selects it"
        )
    resolved = resolved_config(checked, "sd35m_geneval")
    sd35m_common(resolved, tiny_models["sd3"], kl=0.04)
    [reward] = resolved["rewards"]
    assert (reward["name"], reward["weight"], reward["score"]) == ("geneval", 1.0, "partial")
    assert reward["detector"] == str(tiny_models["detector"])
    assert resolved["data"]["prompts_file"] == "dataset/geneval/train_metadata.jsonl"
    assert resolved["eval"]["prompts_file"] == "dataset/geneval/test_metadata.jsonl"
    assert (resolved["eval"]["samples"], resolved["eval"]["metric"]) == (2212, "geneval/correct")


def test_sd35m_ocr(checked, tiny_models):
    resolved = resolved_config(checked, "sd35m_ocr")
    sd35m_common(resolved, tiny_models["sd3"], kl=0.04)
    [reward] = resolved["rewards"]
    assert (reward["name"], reward["weight"], reward["engine"], reward["case_sensitive"]) == (
        "ocr",
        1.0,
        "rapidocr",
        False,
    )
    assert (resolved["data"]["prompts_file"], resolved["eval"]["prompts_file"]) == (
        "dataset/ocr/train.txt",
        "dataset/ocr/test.txt",
    )
    assert resolved["eval"]["samples"] == 2036  # Flow-GRPO's 1018 test prompts, two samples each


def test_sd35m_pickscore(checked, tiny_models):
    resolved = resolved_config(checked, "sd35m_pickscore")
    sd35m_common(resolved, tiny_models["sd3"], kl=0.01)
    [reward] = resolved["rewards"]
    assert (reward["name"], reward["weight"], reward["scale"]) == ("pickscore", 1.0, 26.0)
    assert (resolved["data"]["prompts_file"], resolved["eval"]["prompts_file"]) == (
        "dataset/pickscore/train.txt",
        "dataset/pickscore/test.txt",
    )
    assert resolved["eval"]["samples"] == 4096


def test_flux_pickscore_hps(checked, tiny_models):
    resolved = resolved_config(checked, "flux_pickscore_hps")
    flow_grpo_core(
        resolved,
        noise_level=0.9,
        clip_range=1e-4,
        num_steps=6,
        eval_steps=28,
        guidance=3.5,
        batch=1152,
        group=24,
        learning_rate=3e-4,
    )
    backbone = resolved["backbone"]
    assert (backbone["name"], backbone["pretrained"], backbone["dtype"]) == (
        "flux",
        str(tiny_models["flux"]),
        "bfloat16",
    )
    assert (backbone["height"], backbone["width"], backbone["max_sequence_length"]) == (512, 512, 128)
    assert (backbone["lora"]["rank"], backbone["lora"]["alpha"]) == (64, 128.0)
    assert "ff.net.2" in backbone["lora"]["target_modules"]  # Flow-GRPO's FLUX targets include the feed-forwards
    assert [(r["name"], r["weight"]) for r in resolved["rewards"]] == [("pickscore", 1.0), ("hpsv2", 1.0)]
    assert resolved["rewards"][1]["checkpoint"] == "HPS_v2.1_compressed.pt"
    assert (resolved["advantage"]["combine"], resolved["advantage"]["std"]) == ("normalize_each", "global")
    assert resolved["regularizers"] == []  # Flow-GRPO's FLUX runs have beta 0
    assert resolved["objective"]["skip_zero_advantage"] is False
    assert (resolved["eval"]["every"], resolved["eval"]["metric"], resolved["eval"]["samples"]) == (
        30,
        "pickscore",
        4096,
    )


def test_wan_video_remote_checks_without_its_server(checked, tiny_models):
    resolved = resolved_config(checked, "wan_video_remote")
    flow_grpo_core(
        resolved,
        noise_level=0.7,
        clip_range=1e-3,
        num_steps=20,
        eval_steps=50,
        guidance=4.5,
        batch=128,
        group=4,
        learning_rate=1e-4,
    )
    backbone = resolved["backbone"]
    assert (backbone["name"], backbone["pretrained"]) == ("wan", str(tiny_models["wan"]))
    assert (backbone["num_frames"], backbone["height"], backbone["width"]) == (33, 240, 416)
    assert (backbone["lora"]["rank"], backbone["lora"]["alpha"]) == (32, 64.0)
    assert sorted(backbone["lora"]["target_modules"]) == sorted(WAN_LORA_TARGETS)
    [reward] = resolved["rewards"]
    assert (reward["name"], reward["url"], reward["reward"], reward["kinds"]) == (
        "remote",
        "http://127.0.0.1:8000",
        "videoalign",
        ["video"],
    )
    assert [(r["name"], r["weight"], r["scale"]) for r in resolved["regularizers"]] == [
        ("gaussian_kl", 0.004, "flow_grpo")
    ]
    assert resolved["advantage"]["std"] == "group"
    assert (resolved["data"]["prompts_file"], resolved["eval"]["prompts_file"]) == (
        "dataset/video/train.txt",
        "dataset/video/test.txt",
    )


@pytest.mark.parametrize(
    "recipe, model, reward_models",
    [
        (
            "sd35m_geneval",
            "stabilityai/stable-diffusion-3.5-medium",
            [{"detector": "facebook/mask2former-swin-small-coco-instance"}],
        ),
        ("sd35m_ocr", "stabilityai/stable-diffusion-3.5-medium", [{"engine": "rapidocr"}]),
        (
            "sd35m_pickscore",
            "stabilityai/stable-diffusion-3.5-medium",
            [{"model": "yuvalkirstain/PickScore_v1", "processor": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"}],
        ),
        (
            "flux_pickscore_hps",
            "black-forest-labs/FLUX.1-dev",
            [
                {"model": "yuvalkirstain/PickScore_v1", "processor": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"},
                {"checkpoint": "HPS_v2.1_compressed.pt", "model": "ViT-H-14"},
            ],
        ),
        ("wan_video_remote", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", [{"url": "http://127.0.0.1:8000"}]),
    ],
)
def test_the_recipes_name_the_models_the_field_trains(recipe, model, reward_models):
    """The hub ids the tests above replace with tiny folders, as the yaml ships them."""
    shipped = yaml.safe_load((CONFIGS / f"{recipe}.yaml").read_text())
    assert shipped["backbone"]["pretrained"] == model
    assert len(shipped["rewards"]) == len(reward_models)
    for reward, expected in zip(shipped["rewards"], reward_models):
        assert {key: reward[key] for key in expected} == expected


def test_a_recipe_run_away_from_its_prompt_sets_names_the_files_to_point_at(tmp_path):
    """From a folder without Flow-GRPO's dataset/ the check fails before any model loads, naming both prompt files
    (the hub id's message depends on the local cache, so it is not asserted)."""
    done = subprocess.run(
        [sys.executable, "-m", "gyremedia.cli", "config", str(CONFIGS / "sd35m_pickscore.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "data.prompts_file='dataset/pickscore/train.txt': no such file" in done.stderr
    assert "eval.prompts_file='dataset/pickscore/test.txt': no such file" in done.stderr
