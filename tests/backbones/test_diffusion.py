"""The Stable Diffusion (UNet, epsilon / v-prediction) backbone on its tiny replica: our DDIM sampler reproduces
the stock StableDiffusionPipeline; the noise levels and timesteps are the scheduler's; the conversions between
the UNet's prediction, the flow path the forward-process objectives use and ``scheduler.add_noise`` are exact;
replayed DDIM-eta log-probs equal the rollout's and the on-policy GRPO ratio is 1; LoRA wraps the UNet's
attention and switches off to the base; exports (merged, and LoRA alone) round-trip through stock diffusers in
a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from backbone_checks import (  # noqa: F401 - one_thread is an autouse fixture
    check_adapters_switch_off,
    ode_samples,
    one_thread,
    stock_in_fresh_process,
)
from omegaconf import OmegaConf

from gyremedia.backbones.diffusion import DiffusionBackbone, flow_to_vp, split_prediction
from gyremedia.interfaces import BuildContext, ObjectiveContext
from gyremedia.objectives.grpo import GRPOObjective, GRPOOptions
from gyremedia.options import validate
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Rollout
from gyremedia.sampling import renoise, replay_transition, sample_generators, sample_trajectories
from gyremedia_samplers.ddim import DDIMEtaOptions, DDIMEtaSampler

PLUGINS = PluginManager()
PROMPTS, SEEDS = ["a red circle", "two green triangles"], [5, 6]
PREDICTIONS = ["epsilon", "v_prediction"]
DDIM = DDIMEtaSampler(DDIMEtaOptions(eta=0.0))  # deterministic DDIM: the stock pipeline's default step


def build(name: str = "diffusion", **overrides) -> DiffusionBackbone:
    """The backbone from options merged as a run's config merges them (so the defaults are the schema's)."""
    component = PLUGINS.component("backbone", name)
    options = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(component.options), overrides))
    assert validate(options) == []
    return component.build(options, BuildContext(device=torch.device("cpu")))


def ours(backbone: DiffusionBackbone, num_steps: int, guidance_scale: float) -> torch.Tensor:
    return ode_samples(backbone, PROMPTS, SEEDS, num_steps, guidance_scale, sampler=DDIM).data


def stock(backbone: DiffusionBackbone, num_steps: int, guidance_scale: float) -> torch.Tensor:
    """The stock pipeline's own call, drawing its noise from the same generators."""
    return backbone.pipeline(
        PROMPTS,
        num_inference_steps=num_steps,
        guidance_scale=guidance_scale,
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        output_type="pt",
        **backbone.generation_arguments(),
    ).images


# (backbone, tiny pipeline): SD 1.x/2.x with either parameterisation, a bidirectional T5 text encoder in CLIP's
# place, a zero-terminal-SNR schedule, and SDXL
VARIANTS = [
    pytest.param("diffusion", {"prediction_type": "epsilon"}, id="sd-epsilon"),
    pytest.param("diffusion", {"prediction_type": "v_prediction"}, id="sd-v"),
    pytest.param("diffusion", {"prediction_type": "epsilon", "text_encoder": "t5"}, id="sd-epsilon-t5"),
    pytest.param("diffusion", {"prediction_type": "v_prediction", "zero_terminal_snr": True}, id="sd-v-zero-snr"),
    pytest.param("diffusion_xl", {"prediction_type": "epsilon"}, id="sdxl-epsilon"),
]


@pytest.mark.parametrize("name,tiny", VARIANTS)
@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_our_ddim_equals_the_stock_pipeline(name, tiny, guidance_scale):
    backbone = build(name, tiny=tiny)
    expected = stock(backbone, 4, guidance_scale)
    torch.testing.assert_close(ours(backbone, 4, guidance_scale), expected, atol=2e-4, rtol=0)
    assert expected.shape == (2, 3, 16, 16)


def test_sdxl_conditions_on_both_encoders_pooled_embedding_and_sizes():
    backbone = build("diffusion_xl")
    assert type(backbone.pipeline).__name__ == "StableDiffusionXLPipeline"
    conditions = backbone.encode(PROMPTS)
    assert conditions["prompt_embeds"].shape == (2, 16, 64) and conditions["text_embeds"].shape == (2, 32)
    x, sigma = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor(0.5)
    base = backbone.predict(x, sigma, conditions)
    for key in ("prompt_embeds", "text_embeds"):  # both reach the UNet
        assert not torch.allclose(backbone.predict(x, sigma, {**conditions, key: conditions[key] * 0}), base)
    inputs = backbone.transformer_inputs(x, torch.zeros(2), conditions, 1.0)
    assert inputs["added_cond_kwargs"]["time_ids"].tolist() == [[16, 16, 0, 0, 16, 16]] * 2
    negative = backbone.negative_conditions(2)  # the stock call's unconditional branch: zeros for an empty prompt
    assert all((v == 0).all() for v in negative.values())


def test_sigmas_and_timesteps_are_the_schedulers():
    backbone = build()
    scheduler = backbone.pipeline.scheduler
    for num_steps in (1, 4, 10):
        sigmas = backbone.sigmas(num_steps)
        scheduler.set_timesteps(num_steps)
        alpha_bars = torch.cat(
            [scheduler.alphas_cumprod[scheduler.timesteps], scheduler.final_alpha_cumprod.reshape(1)]
        )
        assert torch.equal(sigmas, (1 - alpha_bars).sqrt())
        assert (sigmas[:-1] < 1).all() and torch.all(sigmas[1:] < sigmas[:-1])  # decreasing, never pure noise
        # the UNet sees exactly the pipeline's integer timesteps at these levels
        assert torch.equal(backbone.model_timestep(sigmas[:-1]), scheduler.timesteps.float())
    assert backbone.model_timestep(torch.tensor([0.0, 1.0])).tolist() == [0.0, 999.0]  # clamped to the trained range


def test_a_zero_terminal_snr_schedule_starts_from_pure_noise_where_the_unet_is_defined():
    """Rescaled betas (Lin et al.): the first DDIM level is sigma = 1 (the UNet's timestep 999), where a
    v-prediction UNet still says what the clean sample is: ``flow_velocity`` at t = 1 is ``x - x0``."""
    backbone = build(tiny={"prediction_type": "v_prediction", "zero_terminal_snr": True})
    sigmas = backbone.sigmas(10)
    assert sigmas[0] == 1 and torch.all(sigmas[1:] < sigmas[:-1])
    assert backbone.model_timestep(sigmas[:1]).tolist() == [999.0]
    x, conditions = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), backbone.encode(PROMPTS)
    v = backbone.predict(x, sigmas[0], conditions)  # at pure noise v = -x0
    torch.testing.assert_close(backbone.flow_velocity(x, torch.ones(2), conditions), x + v, atol=1e-5, rtol=0)
    from gyremedia.tiny.sd import TinySDOptions

    errors = [str(e) for e in validate(TinySDOptions(zero_terminal_snr=True))]  # an epsilon UNet cannot
    assert len(errors) == 1 and "zero_terminal_snr" in errors[0] and "v_prediction" in errors[0]


@pytest.mark.parametrize("prediction", [*PREDICTIONS, "sample"])
def test_prediction_conversions_agree_with_add_noise(prediction):
    """``scheduler.add_noise`` states, the scheduler's own training targets, and the flow path's scaled states."""
    from gyremedia.tiny.sd import sd_scheduler

    scheduler = sd_scheduler(prediction)
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    timesteps = torch.tensor([0, 250, 700, 999])
    z = scheduler.add_noise(x0, eps, timesteps)
    alpha_bar = scheduler.alphas_cumprod[timesteps]
    sigma = (1 - alpha_bar).sqrt()
    target = {"epsilon": eps, "v_prediction": scheduler.get_velocity(x0, eps, timesteps), "sample": x0}[prediction]
    eps_hat, x0_hat = split_prediction(target, z, sigma, prediction)
    torch.testing.assert_close(eps_hat, eps, atol=1e-4 if prediction == "sample" else 1e-5, rtol=0)
    torch.testing.assert_close(x0_hat, x0, atol=1e-3 if prediction == "epsilon" else 1e-5, rtol=0)  # 1/sqrt(a) at 999
    # the flow state at t = sigma / (sigma + sqrt(alpha_bar)), scaled by c, is the scheduler's state
    t = sigma / (sigma + alpha_bar.sqrt())
    scale, vp_sigma = flow_to_vp(t)
    torch.testing.assert_close(scale.view(-1, 1, 1, 1) * renoise(x0, eps, t), z, atol=1e-5, rtol=0)
    torch.testing.assert_close(vp_sigma, sigma, atol=1e-6, rtol=0)


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_flow_velocity_of_an_exact_unet_is_the_flow_target(prediction):
    """With the UNet replaced by the exact prediction of the VP state it is given, ``flow_velocity`` at the flow
    state ``(1 - t) x0 + t eps`` is ``eps - x0`` (what nft/awm/vgrpo/pairwise train towards)."""
    backbone = build(tiny={"prediction_type": prediction})
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([0.1, 0.5, 0.85])
    scale, sigma = flow_to_vp(t)
    alpha = (1 - sigma**2).sqrt().view(-1, 1, 1, 1)
    seen = {}

    def exact_unet(reference, *, sample, timestep, encoder_hidden_states):
        seen.update(sample=sample, timestep=timestep)
        return eps if prediction == "epsilon" else alpha * eps - sigma.view(-1, 1, 1, 1) * x0

    backbone._forward = exact_unet
    v = backbone.flow_velocity(renoise(x0, eps, t), t, backbone.encode(PROMPTS[:1] * 3))
    torch.testing.assert_close(v, eps - x0, atol=1e-5, rtol=0)
    torch.testing.assert_close(seen["sample"], alpha * x0 + sigma.view(-1, 1, 1, 1) * eps, atol=1e-5, rtol=0)
    # the fractional timestep sits at the state's level in the scheduler's table
    torch.testing.assert_close(backbone._timestep_sigmas[seen["timestep"].round().long()], sigma, atol=2e-3, rtol=0)
    # and predict() gives the sampler diffusers' v on VP states, from either parameterisation
    torch.testing.assert_close(
        backbone.predict(seen["sample"], sigma, backbone.encode(PROMPTS[:1] * 3)),
        alpha * eps - sigma.view(-1, 1, 1, 1) * x0,
        atol=1e-5,
        rtol=0,
    )


def rollout_of(backbone, sampler, steps: int = 4, guidance_scale: float = 1.0) -> Rollout:
    conditions = backbone.encode(PROMPTS * 2)
    ids = list(range(4))
    states, log_probs, sigmas = sample_trajectories(
        backbone,
        sampler,
        conditions,
        initial_generators=sample_generators(0, 0, 0, ids),
        step_generators=sample_generators(0, 0, 1, ids),
        num_steps=steps,
        guidance_scale=guidance_scale,
    )
    return Rollout(
        prompts=PROMPTS * 2,
        sample_ids=torch.arange(4),
        group_ids=torch.tensor([0, 1, 0, 1]),
        conditions=conditions,
        states=states,
        log_probs=log_probs,
        sigmas=sigmas,
        advantages=torch.tensor([1.0, -1.0, -1.0, 1.0]),
    )


@pytest.mark.parametrize("name,tiny", VARIANTS)
def test_replayed_ddim_log_probs_equal_the_rollouts_and_the_on_policy_ratio_is_one(name, tiny):
    backbone = build(name, tiny=tiny, lora={"enabled": True})
    sampler = DDIMEtaSampler(DDIMEtaOptions(eta=1.0))  # DDPO's
    rollout = rollout_of(backbone, sampler, guidance_scale=3.0)
    assert torch.isfinite(rollout.log_probs).all()  # eta = 1: every step stochastic (SD's last goes to alpha_bar[0])
    ctx = ObjectiveContext(backbone=backbone, sampler=sampler, guidance_scale=3.0, step=0)
    for i in range(rollout.num_transitions):
        transition, _ = replay_transition(ctx, rollout, i)
        torch.testing.assert_close(transition.log_prob, rollout.log_probs[:, i], atol=1e-5, rtol=0)
    objective = GRPOObjective(GRPOOptions(), BuildContext(device=torch.device("cpu")))
    assert objective.micro_steps(rollout, 0) == [0, 1, 2, 3]
    for micro_step in objective.micro_steps(rollout, 0):
        output = objective.loss(ctx, rollout, micro_step)
        assert output.metrics["ratio"].item() == 1.0  # exactly: the same forward as the rollout's
        output.loss.backward()
    grads = [p.grad for p in backbone.trainable_module().parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_default_lora_targets_wrap_the_unets_attention_and_switch_off_to_the_base():
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = build()
    backbone = build(lora={"enabled": True})
    wrapped = {n for n, m in backbone.transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    leaves = {n.rsplit(".", 2)[-1] if n.endswith("to_out.0") else n.rsplit(".", 1)[-1] for n in wrapped}
    assert {n.split(".attn")[-1] for n in wrapped} and leaves == {"to_q", "to_k", "to_v", "0"}
    # down, mid and up blocks: self- and cross-attention (attn1, attn2), 4 projections each
    assert len(wrapped) == 8 * sum(
        1 for n, _ in backbone.transformer.named_modules() if n.endswith("transformer_blocks.0")
    )
    assert all(p.requires_grad == ("lora_" in n) for n, p in backbone.transformer.named_parameters())
    check_adapters_switch_off(base, backbone, 4.0, PROMPTS, SEEDS)


def test_trainer_and_core_name_no_concrete_backbone():
    root = Path(__file__).parents[2] / "gyremedia"
    stages = [str(p.relative_to(root)) for p in sorted((root / "stages").glob("*.py"))]
    for path in ["trainer.py", *stages, "sampling.py", "objectives/forward_process.py", "backbones/denoising.py"]:
        text = (root / path).read_text().lower()
        for word in ("unet", "stablediffusion", "diffusion_backbone", "epsilon", "v_prediction"):
            assert word not in text, f"{path} names {word!r}"


@pytest.mark.parametrize("name,tiny", VARIANTS)
def test_exports_merged_and_lora_alone_round_trip_through_stock_diffusers(tmp_path, name, tiny):
    base_folder = tmp_path / "base"
    build(name, tiny=tiny).save_pretrained(base_folder)
    backbone = build(name, pretrained=str(base_folder), lora={"enabled": True})
    with torch.no_grad():  # lora_B starts at zero: make the adapters change the images
        for key, p in backbone.transformer.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    expected = ours(backbone, 4, 3.0).numpy()
    assert not np.allclose(expected, ours(build(name, pretrained=str(base_folder)), 4, 3.0).numpy(), atol=1e-3)
    backbone.save_pretrained(tmp_path / "merged")
    index = json.loads((tmp_path / "merged" / "model_index.json").read_text())
    assert index["_class_name"] == backbone.pipeline_class
    assert index.get("requires_safety_checker", False) is False
    merged = stock_in_fresh_process(
        backbone, tmp_path / "merged", None, tmp_path / "merged.npy", 4, 3.0, PROMPTS, SEEDS
    )
    np.testing.assert_allclose(merged, expected, atol=2e-4)
    backbone.save_pretrained(tmp_path / "lora", merge_lora=False)
    assert not (tmp_path / "lora" / "unet").exists()
    adapters = stock_in_fresh_process(
        backbone, base_folder, tmp_path / "lora", tmp_path / "lora.npy", 4, 3.0, PROMPTS, SEEDS
    )
    np.testing.assert_allclose(adapters, expected, atol=2e-4)
    readme = (tmp_path / "lora" / "README.md").read_text()
    assert backbone.pipeline_class in readme and "load_lora_weights" in readme and "height=16" in readme


def test_the_config_pairs_the_diffusion_backbone_with_vp_samplers(make_config):
    from gyremedia.config import ConfigError

    with pytest.raises(
        ConfigError,
        match="sampler 'flow_sde' steps on velocity predictions, but backbone "
        "'diffusion' predicts v_prediction: choose one of ddim_eta",
    ):
        make_config("backbone={name: diffusion}", "sampler={name: flow_sde}")
    config = make_config(
        "backbone={name: diffusion}",
        "sampler={name: ddim_eta}",
        "objective={name: nft}",
        "eval.sampler={name: ddim_eta, eta: 0.0}",
    )
    assert config.backbone.name == "diffusion" and config.sampler.name == "ddim_eta"
