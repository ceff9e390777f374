"""gyremedia beside Flow-GRPO's and DiffusionNFT's own code, on the same tiny pipeline, prompts and noise.

    python benchmarks/peers.py --flow-grpo PATH [--diffusion-nft PATH] [--batch 32] [--repeats 3] [--compile]
                               [--train 150]

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
  gyremedia's ``grpo`` objective through ``Trainer.optimize``;
* **sampling + training step**: the two above added, and gyremedia's whole step with
  ``train.reuse_rollout_forward`` timed as one (its rollout keeps the forwards of the 3 trained transitions with
  their graphs, and the update trains on them instead of running the model again).

``--diffusion-nft``: its ``pipeline_with_logprob`` with its default solver (``dpm2``, deterministic) against
gyremedia's ``ode`` rollout of the NFT quickstart (``configs/quickstart_nft.yaml``), and one optimizer step of
DiffusionNFT over the 2 re-noised levels of that config: its training loop's body (the old policy's forward
without gradient, the policy's forward, the positive and implicit negative x0 losses with adaptive weights,
backward; written here from its code, which is inline in ``scripts/train_nft_sd3.py``), its LoRA-only
reference forward left out as the quickstart has no KL, against gyremedia's ``nft`` through
``Trainer.optimize``. With the old policy's decay at 0 and one update per rollout gyremedia takes the old
prediction from the policy's own forward (``ForwardProcessObjective.old_is_current``; a test shows the run is
the same to the bit); DiffusionNFT runs the old policy's forward every time (its decay is 0 only at step 0).
Then the two added, as a whole step.

``--compile``: gyremedia's whole steps again with ``train.compile`` (the policy's network compiled by
``torch.compile``; each variant runs one untimed step first, which compiles), for Flow-GRPO also with
``train.reuse_rollout_forward``. Neither peer compiles its model, so their code runs as published: eager.

``--train STEPS`` (with ``--flow-grpo``; ``--seed``, ``--eval-every``): held-out gains. Two trainers on
``configs/quickstart_grpo.yaml`` start from the same weights; one trains with gyremedia's ``train_step``, the
other with Flow-GRPO's training loop (``scripts/train_sd3.py``, reproduced around its own
``pipeline_with_logprob``, ``sde_step_with_logprob``, ``PerPromptStatTracker`` and ``EMAModuleWrapper``: its
zero-advantage filter, 2 optimizer steps per rollout over the first 3 transitions, advantages clipped at 5,
KL 0.04 against the frozen base, EMA at its decay 0.9 every 8 steps; each setting read from the run's config
as the config's comment maps it, and ``--set KEY=VALUE`` overrides both runs). Its zero-advantage filter has no
switch. Steps alternate in one process, and both are evaluated by gyremedia's held-out evaluation (the run's
``eval`` section), the EMA weights as well.

What is not matched: their reward servers, LoRA loading and multi-GPU gathering, and the solvers of the two
NFT rollouts (DiffusionNFT's second-order multistep ``dpm2`` against gyremedia's Euler ``ode``: the same
number of transformer calls).
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

from gyremedia import evaluation
from gyremedia.config import load_config, resolve_config
from gyremedia.plugins import PluginManager
from gyremedia.rollout import Media, Rollout
from gyremedia.runtime.streams import Stream, sample_generators
from gyremedia.sampling import sample_trajectories
from gyremedia.stages.rollout import collect, rollout_request
from gyremedia.stages.scoring import gyremedia_score_rollout
from gyremedia.stages.update import gyremedia_update
from gyremedia.trainer import Trainer

QUICKSTART_GRPO = Path(__file__).resolve().parents[1] / "configs" / "quickstart_grpo.yaml"
QUICKSTART_NFT = Path(__file__).resolve().parents[1] / "configs" / "quickstart_nft.yaml"
STEPS, NOISE_LEVEL, TRAINED, CLIP = 10, 0.7, 3, 1e-4


def best_of(repeats: int, function) -> tuple[float, object]:
    """The fastest of ``repeats`` calls and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def trainer_on(config: Path, tmp: str, *overrides: str) -> Trainer:
    """A set-up trainer on ``config`` with the ``overrides``, writing under ``tmp``, no progress bars."""
    pm = PluginManager()
    trainer = Trainer(
        resolve_config(load_config(config, [f"run.output_dir={tmp}", "logging.progress=false", *overrides]), pm), pm
    )
    trainer.setup()
    return trainer


def quickstart(config: Path, batch: int, tmp: str, *extra: str):
    """A trainer on ``config`` (batch ``batch``, no KL, one minibatch, then the ``extra`` overrides), its state,
    and step 0's prompts, their conditions and initial noise."""
    trainer = trainer_on(
        config, tmp, "regularizers=[]", "train.num_minibatches=1", f"rollout.batch_size={batch}", *extra
    )
    state = trainer.state
    prompts = rollout_request(state, 0).prompts
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
        backbone,
        state.sampler,
        conditions,
        initial_generators=sample_generators(0, 0, Stream.INITIAL_NOISE, ids),
        step_generators=sample_generators(0, 0, Stream.STEP_NOISE, ids),
        num_steps=STEPS,
        guidance_scale=1.0,
    )
    backbone.decode(states[:, -1])
    return states, log_probs, sigmas


def flow_grpo_rows(
    clone: Path, batch: int, repeats: int, compiled: bool
) -> tuple[list[tuple[str, float, float]], float]:
    """Sampling and training-step times of Flow-GRPO's code and gyremedia's, and the log-prob parity."""
    their_package(clone)
    from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob

    with tempfile.TemporaryDirectory() as tmp:
        trainer, state, prompts, ids, conditions, noise = quickstart(
            QUICKSTART_GRPO, batch, tmp, "objective.skip_zero_advantage=false"
        )
        backbone, sampler, pipe = state.backbone, state.sampler, state.backbone.pipeline
        size = backbone.generation_arguments()

        def theirs_sample():
            return pipeline_with_logprob(
                pipe,
                prompt_embeds=conditions["prompt_embeds"],
                pooled_prompt_embeds=conditions["pooled_projections"],
                latents=noise.clone(),
                num_inference_steps=STEPS,
                guidance_scale=1.0,
                output_type="pt",
                noise_level=NOISE_LEVEL,
                generator=torch.Generator().manual_seed(0),
                **size,
            )

        backbone.trainable_module().eval()
        their_time, (_, their_latents, their_log_probs) = best_of(repeats, theirs_sample)
        our_time, (_, _, sigmas) = best_of(repeats, lambda: ours_sample(state, conditions, ids))
        their_states = torch.stack(their_latents, dim=1)
        their_log_probs = torch.stack(their_log_probs, dim=1)
        with torch.no_grad():  # gyremedia scores Flow-GRPO's own transitions
            ours = torch.stack(
                [
                    sampler.step(
                        their_states[:, i],
                        backbone.predict(their_states[:, i], sigmas[i], conditions),
                        sigmas,
                        i,
                        next_state=their_states[:, i + 1],
                    ).log_prob
                    for i in range(STEPS)
                ],
                dim=1,
            )
        parity = (ours - their_log_probs).abs().max().item()

        advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(1))
        rollout = Rollout(
            prompts=prompts,
            sample_ids=torch.tensor(ids),
            group_ids=torch.tensor(ids) // 8,
            conditions=conditions,
            states=their_states,
            log_probs=their_log_probs,
            sigmas=sigmas,
            advantages=advantages,
        )
        scheduler = pipe.scheduler
        scheduler.set_timesteps(STEPS)
        timesteps = scheduler.timesteps

        def theirs_train():
            module = backbone.trainable_module()
            module.train()
            for j in range(TRAINED):  # Flow-GRPO's loop body for one transition
                t = timesteps[j].expand(len(prompts))
                noise_pred = module(
                    hidden_states=their_states[:, j],
                    timestep=t,
                    encoder_hidden_states=conditions["prompt_embeds"],
                    pooled_projections=conditions["pooled_projections"],
                    return_dict=False,
                )[0]
                _, log_prob, _, _ = sde_step_with_logprob(
                    scheduler,
                    noise_pred.float(),
                    t,
                    their_states[:, j].float(),
                    prev_sample=their_states[:, j + 1].float(),
                    noise_level=NOISE_LEVEL,
                )
                ratio = torch.exp(log_prob - their_log_probs[:, j])
                clipped = -advantages * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
                loss = torch.maximum(-advantages * ratio, clipped).mean()
                (loss / TRAINED).backward()
            their_update(module, state.optimizer)

        their_step, _ = best_of(repeats, theirs_train)
        our_step, _ = best_of(repeats, lambda: gyremedia_update(trainer.state, rollout, 0))
        variants = {"train.reuse_rollout_forward": ["train.reuse_rollout_forward=true"]}
        if compiled:
            variants |= {
                "train.compile": ["train.compile=true"],
                "train.compile and train.reuse_rollout_forward": [
                    "train.compile=true",
                    "train.reuse_rollout_forward=true",
                ],
            }
        whole = whole_step_times(
            QUICKSTART_GRPO, batch, tmp, repeats, advantages, variants, "objective.skip_zero_advantage=false"
        )
    return [
        ("Flow-GRPO: sampling (with decode)", their_time, our_time),
        (f"Flow-GRPO: training step, first {TRAINED} transitions", their_step, our_step),
        ("Flow-GRPO: sampling + training step", their_time + their_step, our_time + our_step),
        *[
            (f"Flow-GRPO: sampling + training step, gyremedia with {label}", their_time + their_step, seconds)
            for label, seconds in whole.items()
        ],
    ], parity


def whole_step_times(
    config: Path,
    batch: int,
    tmp: str,
    repeats: int,
    advantages: torch.Tensor,
    variants: dict[str, list[str]],
    *common: str,
) -> dict[str, float]:
    """The best of ``repeats`` whole steps of gyremedia (its rollout of step 0's prompts and noise, decoded, then
    its update on ``advantages``) for each variant's overrides, after one untimed step (a compiled one compiles)."""
    seconds = {}
    for label, overrides in variants.items():
        trainer = quickstart(config, batch, f"{tmp}/{len(seconds)}", *common, *overrides)[0]

        def step():
            rollout = collect(trainer.state, 0)
            trainer.state.backbone.decode(rollout.final)
            rollout.advantages = advantages
            gyremedia_update(trainer.state, rollout, 0)

        step()
        seconds[label] = best_of(repeats, step)[0]
    return seconds


def heldout_accuracy(trainer: Trainer) -> float:
    """The trainer's held-out accuracy (%): its run's evaluation (fixed-seed samples, the eval sampler)."""
    result = evaluation.evaluate(
        trainer.config, trainer.state.backbone, trainer.state.eval_sampler, trainer.state.rewards
    )
    return 100 * result.means()[f"eval/{evaluation.accuracy_key(trainer.config)}"]


class FlowGRPOLoop:
    """Flow-GRPO's training loop (``scripts/train_sd3.py``, one epoch of 2 batches per step) around its own
    sampling, SDE step, per-prompt stat tracker and EMA, on a gyremedia trainer's model, optimizer, prompts,
    initial noise and rewards. Its settings are the run's config's, mapped as that config's comment maps them."""

    def __init__(self, clone: Path, trainer: Trainer, seed: int) -> None:
        their_package(clone)
        from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
        from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob
        from flow_grpo.ema import EMAModuleWrapper
        from flow_grpo.stat_tracking import PerPromptStatTracker

        self.sample, self.sde_step = pipeline_with_logprob, sde_step_with_logprob
        self.trainer, self.seed = trainer, seed
        self.module = trainer.state.backbone.trainable_module()
        self.reference = copy.deepcopy(self.module).eval().requires_grad_(False)  # its adapter-disabled base
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.ema = EMAModuleWrapper(self.params, decay=0.9, update_step_interval=8)  # its train.ema settings
        config, objective = trainer.config, trainer.config.objective
        self.tracker = PerPromptStatTracker(global_std=config.core.advantage.std == "global")
        self.global_step = 0
        self.batches = config.core.train.num_minibatches  # num_batches_per_epoch: one optimizer step each
        self.beta = sum(r.weight for r in config.regularizers if r.name == "gaussian_kl")  # train.beta
        self.trained = math.floor(config.core.rollout.num_steps * objective.options.timestep_fraction)
        self.clip, self.adv_clip_max = objective.options.clip_range, objective.options.adv_clip_max
        self.noise_level, self.num_steps = config.sampler.options.noise_level, config.core.rollout.num_steps

    def log_prob(self, net: torch.nn.Module, latents, timesteps, j: int, conditions):
        """Its ``compute_log_prob`` (no CFG): the log-prob of transition ``j`` and the step's mean and std."""
        t = timesteps[j].expand(len(latents))
        prediction = net(
            hidden_states=latents[:, j],
            timestep=t,
            encoder_hidden_states=conditions["prompt_embeds"],
            pooled_projections=conditions["pooled_projections"],
            return_dict=False,
        )[0]
        _, log_prob, mean, std = self.sde_step(
            self.trainer.state.backbone.pipeline.scheduler,
            prediction.float(),
            t,
            latents[:, j].float(),
            prev_sample=latents[:, j + 1].float(),
            noise_level=self.noise_level,
        )
        return log_prob, mean, std

    def train_step(self, step: int) -> None:
        """Sample step ``step``'s batch with its pipeline, score it with the run's rewards, then its loop's body."""
        trainer, backbone = self.trainer, self.trainer.state.backbone
        request = rollout_request(trainer.state, step)
        ids = request.sample_ids.tolist()
        conditions = backbone.encode(request.prompts)
        noise = backbone.sample_noise(sample_generators(self.seed, step, Stream.INITIAL_NOISE, ids))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        self.module.eval()
        images, latents, old_log_probs = self.sample(
            backbone.pipeline,
            prompt_embeds=conditions["prompt_embeds"],
            pooled_prompt_embeds=conditions["pooled_projections"],
            latents=noise,
            num_inference_steps=self.num_steps,
            guidance_scale=1.0,
            output_type="pt",
            noise_level=self.noise_level,
            generator=generator,
            **backbone.generation_arguments(),
        )
        latents, old_log_probs = torch.stack(latents, dim=1), torch.stack(old_log_probs, dim=1)
        timesteps = backbone.pipeline.scheduler.timesteps
        rollout = Rollout(
            prompts=request.prompts,
            sample_ids=request.sample_ids,
            group_ids=request.group_ids,
            conditions=conditions,
            states=latents,
            log_probs=old_log_probs,
        )
        futures = trainer.state.scorer.submit(Media("image", images.float()), request.prompts)
        gyremedia_score_rollout(trainer.state, rollout, futures, step)
        advantages = torch.as_tensor(
            self.tracker.update(request.prompts, rollout.reward.cpu().numpy()), dtype=torch.float32
        )
        self.tracker.clear()
        keep = advantages != 0  # it drops zero-advantage samples, then re-admits random ones to fill even batches
        missing = -int(keep.sum()) % self.batches
        dropped = torch.where(~keep)[0]
        if missing and len(dropped) >= missing:
            keep[dropped[torch.randperm(len(dropped), generator=generator)[:missing]]] = True
        kept = torch.where(keep)[0]
        self.module.train()
        for batch in kept[torch.randperm(len(kept), generator=generator)].tensor_split(self.batches):
            batch_conditions = {k: v[batch] for k, v in conditions.items()}
            advantage = advantages[batch].clamp(-self.adv_clip_max, self.adv_clip_max)
            for j in range(self.trained):  # accelerate divides each loss by the accumulation steps (the transitions)
                log_prob, mean, std = self.log_prob(self.module, latents[batch], timesteps, j, batch_conditions)
                ratio = torch.exp(log_prob - old_log_probs[batch, j])
                loss = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - self.clip, 1 + self.clip)).mean()
                if self.beta > 0:  # it runs the reference only for a KL term
                    with torch.no_grad():
                        _, reference_mean, _ = self.log_prob(
                            self.reference, latents[batch], timesteps, j, batch_conditions
                        )
                    kl = ((mean - reference_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std**2)
                    loss = loss + self.beta * kl.mean()
                (loss / self.trained).backward()
            their_update(self.module, trainer.state.optimizer)
            self.global_step += 1
            self.ema.step(self.params, self.global_step)

    def ema_accuracy(self) -> float:
        """Held-out accuracy of the EMA weights, which Flow-GRPO evaluates and saves."""
        self.ema.copy_ema_to(self.params, store_temp=True)
        try:
            return heldout_accuracy(self.trainer)
        finally:
            self.ema.copy_temp_to(self.params)


def flow_grpo_training(clone: Path, steps: int, seed: int, eval_every: int, settings: list[str]) -> list[str]:
    """Train gyremedia's recipe and Flow-GRPO's loop from the same base (the recipe with the ``settings``
    overrides, for both), alternating steps; the table of held-out accuracy at every evaluation and the mean
    step times."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.seed={seed}", f"train.steps={steps}", *settings]
        ours = trainer_on(QUICKSTART_GRPO, f"{tmp}/ours", *overrides)
        theirs = FlowGRPOLoop(clone, trainer_on(QUICKSTART_GRPO, f"{tmp}/theirs", *overrides), seed)
        evaluations = sorted({*range(0, steps, eval_every), steps})
        curves: dict[str, list[float]] = {"gyremedia": [], "theirs": [], "theirs_ema": []}
        seconds = {"gyremedia": 0.0, "theirs": 0.0}
        for step in range(steps + 1):
            if step in evaluations:
                curves["gyremedia"].append(heldout_accuracy(ours))
                curves["theirs"].append(heldout_accuracy(theirs.trainer))
                curves["theirs_ema"].append(theirs.ema_accuracy())
                print(f"step {step}: " + ", ".join(f"{k} {v[-1]:.1f}%" for k, v in curves.items()), flush=True)
            if step == steps:
                break
            for name, train_step in (("gyremedia", ours.train_step), ("theirs", theirs.train_step)):
                start = time.perf_counter()
                train_step(step)
                seconds[name] += time.perf_counter() - start
    names = {
        "gyremedia": "gyremedia `grpo` (configs/quickstart_grpo.yaml)",
        "theirs": "Flow-GRPO's training loop, its functions",
        "theirs_ema": "Flow-GRPO's training loop, its EMA weights (what it evaluates)",
    }
    lines = [
        f"held-out accuracy (%), seed {seed}, {steps} steps, both runs in one process, steps alternated"
        + (f", with {' '.join(settings)}" if settings else "")
        + ":",
        "| run | " + " | ".join(f"step {s}" for s in evaluations) + " | gain | seconds per step |",
        "|---|" + "---|" * (len(evaluations) + 2),
    ]
    for key, curve in curves.items():
        per_step = f"{seconds[key] / steps:.3f} s" if key in seconds else "—"
        lines.append(
            f"| {names[key]} | "
            + " | ".join(f"{a:.1f}" for a in curve)
            + f" | {curve[-1] - curve[0]:+.1f} | {per_step} |"
        )
    lines.append(f"step time gyremedia / Flow-GRPO's loop: {seconds['gyremedia'] / seconds['theirs']:.2f}x")
    return lines


def diffusion_nft_rows(clone: Path, batch: int, repeats: int, compiled: bool) -> list[tuple[str, float, float]]:
    """Sampling and training-step times of DiffusionNFT's code and gyremedia's on the NFT quickstart."""
    their_package(clone)
    from flow_grpo.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob

    with tempfile.TemporaryDirectory() as tmp:
        trainer, state, prompts, ids, conditions, noise = quickstart(QUICKSTART_NFT, batch, tmp)
        backbone, pipe, options = state.backbone, state.backbone.pipeline, state.objective.options
        size = backbone.generation_arguments()

        def theirs_sample():
            return pipeline_with_logprob(
                pipe,
                prompt_embeds=conditions["prompt_embeds"],
                pooled_prompt_embeds=conditions["pooled_projections"],
                latents=noise.clone(),
                num_inference_steps=STEPS,
                guidance_scale=1.0,
                output_type="pt",
                deterministic=True,
                solver="dpm2",
                **size,
            )

        backbone.trainable_module().eval()
        their_time, _ = best_of(repeats, theirs_sample)
        our_time, (states, log_probs, sigmas) = best_of(repeats, lambda: ours_sample(state, conditions, ids))
        advantages = torch.randn(len(prompts), generator=torch.Generator().manual_seed(1))
        rollout = Rollout(
            prompts=prompts,
            sample_ids=torch.tensor(ids),
            group_ids=torch.tensor(ids) // 8,
            conditions=conditions,
            states=states,
            log_probs=log_probs,
            sigmas=sigmas,
            advantages=advantages,
        )
        module = backbone.trainable_module()
        old = copy.deepcopy(module)  # DiffusionNFT's "old" adapter; a whole copy here, the quickstart trains fully
        x0 = states[:, -1].float()
        levels = torch.rand(options.timesteps, len(prompts), generator=torch.Generator().manual_seed(2))
        dims = tuple(range(1, x0.dim()))

        def forward(net, xt, t):
            return net(
                hidden_states=xt,
                timestep=t * 1000,
                encoder_hidden_states=conditions["prompt_embeds"],
                pooled_projections=conditions["pooled_projections"],
                return_dict=False,
            )[0]

        def theirs_train():
            module.train()
            r = (advantages.clamp(-options.adv_clip_max, options.adv_clip_max) / options.adv_clip_max / 2 + 0.5).clamp(
                0, 1
            )
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
                loss = (
                    r * ((positive - x0) ** 2 / w_pos).mean(dim=dims) / beta
                    + (1 - r) * ((negative - x0) ** 2 / w_neg).mean(dim=dims) / beta
                )
                ((loss * options.adv_clip_max).mean() / len(levels)).backward()
            their_update(module, state.optimizer)

        their_step, _ = best_of(repeats, theirs_train)
        our_step, _ = best_of(repeats, lambda: gyremedia_update(trainer.state, rollout, 0))
        whole = whole_step_times(
            QUICKSTART_NFT,
            batch,
            tmp,
            repeats,
            advantages,
            {"train.compile": ["train.compile=true"]} if compiled else {},
        )
    return [
        ("DiffusionNFT: sampling (with decode; dpm2 vs Euler)", their_time, our_time),
        (f"DiffusionNFT: training step, {options.timesteps} re-noised levels", their_step, our_step),
        ("DiffusionNFT: sampling + training step", their_time + their_step, our_time + our_step),
        *[
            (f"DiffusionNFT: sampling + training step, gyremedia with {label}", their_time + their_step, seconds)
            for label, seconds in whole.items()
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow-grpo", type=Path, default=None, help="a local clone of yifan123/flow_grpo")
    parser.add_argument("--diffusion-nft", type=Path, default=None, help="a local clone of NVlabs/DiffusionNFT")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time gyremedia's whole steps with train.compile (each compiles first, untimed)",
    )
    parser.add_argument(
        "--train",
        type=int,
        default=0,
        metavar="STEPS",
        help="with --flow-grpo: also train both for STEPS steps and compare held-out gains",
    )
    parser.add_argument("--seed", type=int, default=0, help="the training comparison's run.seed")
    parser.add_argument("--eval-every", type=int, default=50, help="the training comparison's evaluation interval")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for both runs of the training comparison (repeatable)",
    )
    args = parser.parse_args()
    if args.train and args.flow_grpo is None:
        parser.error("--train needs --flow-grpo PATH")
    if args.flow_grpo is None and args.diffusion_nft is None:
        parser.error("give --flow-grpo PATH, --diffusion-nft PATH or both")
    rows, parity = [], None
    if args.flow_grpo is not None:
        flow_grpo, parity = flow_grpo_rows(args.flow_grpo, args.batch, args.repeats, args.compile)
        rows += flow_grpo
    if args.diffusion_nft is not None:
        rows += diffusion_nft_rows(args.diffusion_nft, args.batch, args.repeats, args.compile)

    print(
        f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), "
        f"{torch.accelerator.current_accelerator() if torch.accelerator.is_available() else 'no accelerator'}"
    )
    print(f"quickstart SD3 pipeline, batch {args.batch}, {STEPS} steps, best of {args.repeats}")
    if parity is not None:
        print(
            f"log-prob parity on Flow-GRPO's own transitions (noise level {NOISE_LEVEL}): "
            f"max |ours - theirs| = {parity:.2e}"
        )
    print("| part | their code | gyremedia | gyremedia / theirs |\n|---|---|---|---|")
    for part, theirs, ours in rows:
        print(f"| {part} | {theirs:.3f} s | {ours:.3f} s | {ours / theirs:.2f}x |")
    if args.train:
        print("\n".join(flow_grpo_training(args.flow_grpo, args.train, args.seed, args.eval_every, args.set)))
    if parity is not None and not math.isfinite(parity):
        raise SystemExit("log-probs differ: not finite")


if __name__ == "__main__":
    main()
