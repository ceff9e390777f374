"""gyremedia beside Flow-GRPO's and DiffusionNFT's own code, on the same tiny pipeline, prompts and noise.

    python benchmarks/peers.py --flow-grpo PATH [--diffusion-nft PATH] [--batch 32] [--repeats 3]

Each ``PATH`` is a local clone (github.com/yifan123/flow_grpo, github.com/NVlabs/DiffusionNFT; not part of this
repository and not needed by its tests; both name their package ``flow_grpo``, so each is imported on its own).
Their functions run on the quickstart's SD3 pipeline (``assets/shapes16``, held in gyremedia's ``flow_matching``
backbone: the same transformer object). Printed, the best of ``--repeats`` timings each and their ratios
(gyremedia / theirs):

``--flow-grpo``: its ``pipeline_with_logprob`` (SDE sampling with per-step log-probs) and
``sde_step_with_logprob`` (the step it trains through) against gyremedia's ``flow_sde`` and ``grpo``
(``configs/quickstart_grpo.yaml``):

* **log-prob parity**: Flow-GRPO samples a batch (noise level 0.7, 10 steps, from gyremedia's initial noise);
  gyremedia replays every one of its transitions and scores it: the largest difference of the log-probs;
* **sampling time**: Flow-GRPO's pipeline call against gyremedia's rollout (both decode), the same batch;
* **training step time**: one optimizer step over the first 3 transitions of that batch (Flow-GRPO's
  selection), as Flow-GRPO's training loop computes it (its step function for the log-prob, the clipped ratio
  with clip 1e-4, no KL, written here from its published loss, then backward and AdamW) against
  gyremedia's ``grpo`` objective through ``Trainer.optimize``.

``--diffusion-nft``: its ``pipeline_with_logprob`` with its default solver (``dpm2``, deterministic) against
gyremedia's ``ode`` rollout of the NFT quickstart (``configs/quickstart.yaml``), and one optimizer step of
DiffusionNFT over the 2 re-noised levels of that config: its training loop's body (the old policy's forward
without gradient, the policy's forward, the positive and implicit negative x0 losses with adaptive weights,
backward; written here from its code, which is inline in ``scripts/train_nft_sd3.py``), its LoRA-only
reference forward left out as the quickstart has no KL, against gyremedia's ``nft`` through
``Trainer.optimize``. With the old policy's decay at 0 and one update per rollout gyremedia takes the old
prediction from the policy's own forward (``ForwardProcessObjective.old_is_current``; a test shows the run is
the same to the bit); DiffusionNFT runs the old policy's forward every time (its decay is 0 only at step 0).

What is not matched: held-out gains (the recipes are compared by training runs, docs/benchmarks.md), their
reward servers, EMA and LoRA loading, and the solvers of the two NFT rollouts (DiffusionNFT's second-order
multistep ``dpm2`` against gyremedia's Euler ``ode``: the same number of transformer calls).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Rollout
from gyremedia.sampling import sample_trajectories
from gyremedia.streams import Stream, sample_generators
from gyremedia.trainer import Trainer

QUICKSTART_GRPO = Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"
QUICKSTART_NFT = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
STEPS, NOISE_LEVEL, TRAINED, CLIP = 10, 0.7, 3, 1e-4


def best_of(repeats: int, function) -> tuple[float, object]:
    """The fastest of ``repeats`` calls and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def quickstart(config: Path, batch: int, tmp: str, *extra: str):
    """A trainer on ``config`` (batch ``batch``, no KL, one minibatch, then the ``extra`` overrides), its state,
    and step 0's prompts, their conditions and initial noise."""
    pm = PluginManager()
    overrides = [f"run.output_dir={tmp}", "regularizers=[]", "train.num_minibatches=1", f"rollout.batch_size={batch}",
                 "logging.progress=false", *extra]
    trainer = Trainer(resolve_config(load_config(config, overrides), pm), pm)
    state = trainer.setup()
    prompts = trainer.rollout_request(0).prompts
    ids = list(range(len(prompts)))
    conditions = state.backbone.encode(prompts)
    noise = state.backbone.sample_noise(sample_generators(0, 0, Stream.INITIAL_NOISE, ids))
    return trainer, state, prompts, ids, conditions, noise


def their_package(clone: Path) -> None:
    """Put ``clone`` first on the path with no ``flow_grpo`` package imported yet (both peers name theirs so)."""
    for name in [m for m in sys.modules if m == "flow_grpo" or m.startswith("flow_grpo.")]:
        del sys.modules[name]
    sys.path.insert(0, str(clone))


def their_update(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The end of both peers' training step: gradient clipping at 1, the optimizer step, cleared gradients."""
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def ours_sample(state, conditions, ids):
    """gyremedia's rollout of the batch (the run's sampler), decoded as the trainer decodes it."""
    backbone = state.backbone
    states, log_probs, sigmas = sample_trajectories(
        backbone, state.sampler, conditions, initial_generators=sample_generators(0, 0, Stream.INITIAL_NOISE, ids),
        step_generators=sample_generators(0, 0, Stream.STEP_NOISE, ids), num_steps=STEPS, guidance_scale=1.0)
    backbone.decode(states[:, -1])
    return states, log_probs, sigmas


def flow_grpo_rows(clone: Path, batch: int, repeats: int) -> tuple[list[tuple[str, float, float]], float]:
    """Sampling and training-step times of Flow-GRPO's code and gyremedia's, and the log-prob parity."""
    their_package(clone)
    from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob

    with tempfile.TemporaryDirectory() as tmp:
        trainer, state, prompts, ids, conditions, noise = quickstart(
            QUICKSTART_GRPO, batch, tmp, "objective.skip_zero_advantage=false")
        backbone, sampler, pipe = state.backbone, state.sampler, state.backbone.pipeline
        size = backbone.generation_arguments()

        def theirs_sample():
            return pipeline_with_logprob(pipe, prompt_embeds=conditions["prompt_embeds"],
                                         pooled_prompt_embeds=conditions["pooled_projections"], latents=noise.clone(),
                                         num_inference_steps=STEPS, guidance_scale=1.0, output_type="pt",
                                         noise_level=NOISE_LEVEL, generator=torch.Generator().manual_seed(0), **size)

        backbone.trainable_module().eval()
        their_time, (_, their_latents, their_log_probs) = best_of(repeats, theirs_sample)
        our_time, (_, _, sigmas) = best_of(repeats, lambda: ours_sample(state, conditions, ids))
        their_states = torch.stack(their_latents, dim=1)
        their_log_probs = torch.stack(their_log_probs, dim=1)
        with torch.no_grad():  # gyremedia scores Flow-GRPO's own transitions
            ours = torch.stack([sampler.step(their_states[:, i], backbone.predict(their_states[:, i], sigmas[i], conditions),
                                             sigmas, i, next_state=their_states[:, i + 1]).log_prob
                                for i in range(STEPS)], dim=1)
        parity = (ours - their_log_probs).abs().max().item()

        advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(1))
        rollout = Rollout(prompts=prompts, sample_ids=torch.tensor(ids), group_ids=torch.tensor(ids) // 8,
                          conditions=conditions, states=their_states, log_probs=their_log_probs, sigmas=sigmas,
                          advantages=advantages)
        scheduler = pipe.scheduler
        scheduler.set_timesteps(STEPS)
        timesteps = scheduler.timesteps

        def theirs_train():
            module = backbone.trainable_module()
            module.train()
            for j in range(TRAINED):  # Flow-GRPO's loop body for one transition
                t = timesteps[j].expand(len(prompts))
                noise_pred = module(hidden_states=their_states[:, j], timestep=t,
                                    encoder_hidden_states=conditions["prompt_embeds"],
                                    pooled_projections=conditions["pooled_projections"], return_dict=False)[0]
                _, log_prob, _, _ = sde_step_with_logprob(scheduler, noise_pred.float(), t, their_states[:, j].float(),
                                                          prev_sample=their_states[:, j + 1].float(), noise_level=NOISE_LEVEL)
                ratio = torch.exp(log_prob - their_log_probs[:, j])
                clipped = -advantages * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
                loss = torch.maximum(-advantages * ratio, clipped).mean()
                (loss / TRAINED).backward()
            their_update(module, state.optimizer)

        their_step, _ = best_of(repeats, theirs_train)
        our_step, _ = best_of(repeats, lambda: trainer.optimize(rollout, 0))
        trainer.scorer.close()
    return [("Flow-GRPO: sampling (with decode)", their_time, our_time),
            (f"Flow-GRPO: training step, first {TRAINED} transitions", their_step, our_step)], parity


def diffusion_nft_rows(clone: Path, batch: int, repeats: int) -> list[tuple[str, float, float]]:
    """Sampling and training-step times of DiffusionNFT's code and gyremedia's on the NFT quickstart."""
    their_package(clone)
    from flow_grpo.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob

    with tempfile.TemporaryDirectory() as tmp:
        trainer, state, prompts, ids, conditions, noise = quickstart(QUICKSTART_NFT, batch, tmp)
        backbone, pipe, options = state.backbone, state.backbone.pipeline, state.objective.options
        size = backbone.generation_arguments()

        def theirs_sample():
            return pipeline_with_logprob(pipe, prompt_embeds=conditions["prompt_embeds"],
                                         pooled_prompt_embeds=conditions["pooled_projections"], latents=noise.clone(),
                                         num_inference_steps=STEPS, guidance_scale=1.0, output_type="pt",
                                         deterministic=True, solver="dpm2", **size)

        backbone.trainable_module().eval()
        their_time, _ = best_of(repeats, theirs_sample)
        our_time, (states, log_probs, sigmas) = best_of(repeats, lambda: ours_sample(state, conditions, ids))
        advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(1))
        rollout = Rollout(prompts=prompts, sample_ids=torch.tensor(ids), group_ids=torch.tensor(ids) // 8,
                          conditions=conditions, states=states, log_probs=log_probs, sigmas=sigmas, advantages=advantages)
        module = backbone.trainable_module()
        old = copy.deepcopy(module)  # DiffusionNFT's "old" adapter; a whole copy here, the quickstart trains fully
        x0 = states[:, -1].float()
        levels = torch.rand(options.timesteps, len(prompts), generator=torch.Generator().manual_seed(2))
        dims = tuple(range(1, x0.dim()))

        def forward(net, xt, t):
            return net(hidden_states=xt, timestep=t * 1000, encoder_hidden_states=conditions["prompt_embeds"],
                       pooled_projections=conditions["pooled_projections"], return_dict=False)[0]

        def theirs_train():
            module.train()
            r = (advantages.clamp(-options.adv_clip_max, options.adv_clip_max) / options.adv_clip_max / 2 + 0.5).clamp(0, 1)
            beta = options.beta
            for t in levels:  # DiffusionNFT's loop body for one re-noised level
                t_expanded = t.view(-1, 1, 1, 1)
                xt = (1 - t_expanded) * x0 + t_expanded * torch.randn_like(x0)
                with torch.no_grad():
                    old_prediction = forward(old, xt, t)
                forward_prediction = forward(module, xt, t)
                positive = xt - t_expanded * (beta * forward_prediction + (1 - beta) * old_prediction)
                negative = xt - t_expanded * ((1 + beta) * old_prediction - beta * forward_prediction)
                with torch.no_grad():
                    w_pos = (positive.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
                    w_neg = (negative.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
                loss = (r * ((positive - x0) ** 2 / w_pos).mean(dim=dims) / beta
                        + (1 - r) * ((negative - x0) ** 2 / w_neg).mean(dim=dims) / beta)
                ((loss * options.adv_clip_max).mean() / len(levels)).backward()
            their_update(module, state.optimizer)

        their_step, _ = best_of(repeats, theirs_train)
        our_step, _ = best_of(repeats, lambda: trainer.optimize(rollout, 0))
        trainer.scorer.close()
    return [("DiffusionNFT: sampling (with decode; dpm2 vs Euler)", their_time, our_time),
            (f"DiffusionNFT: training step, {options.timesteps} re-noised levels", their_step, our_step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow-grpo", type=Path, default=None, help="a local clone of yifan123/flow_grpo")
    parser.add_argument("--diffusion-nft", type=Path, default=None, help="a local clone of NVlabs/DiffusionNFT")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.flow_grpo is None and args.diffusion_nft is None:
        parser.error("give --flow-grpo PATH, --diffusion-nft PATH or both")
    rows, parity = [], None
    if args.flow_grpo is not None:
        flow_grpo, parity = flow_grpo_rows(args.flow_grpo, args.batch, args.repeats)
        rows += flow_grpo
    if args.diffusion_nft is not None:
        rows += diffusion_nft_rows(args.diffusion_nft, args.batch, args.repeats)

    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), "
          f"{torch.accelerator.current_accelerator() if torch.accelerator.is_available() else 'no accelerator'}")
    print(f"quickstart SD3 pipeline, batch {args.batch}, {STEPS} steps, best of {args.repeats}")
    if parity is not None:
        print(f"log-prob parity on Flow-GRPO's own transitions (noise level {NOISE_LEVEL}): "
              f"max |ours - theirs| = {parity:.2e}")
    print("| part | their code | gyremedia | gyremedia / theirs |\n|---|---|---|---|")
    for part, theirs, ours in rows:
        print(f"| {part} | {theirs:.3f} s | {ours:.3f} s | {ours / theirs:.2f}x |")
    if parity is not None and not math.isfinite(parity):
        raise SystemExit("log-probs differ: not finite")


if __name__ == "__main__":
    main()
