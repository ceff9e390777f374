"""gyremedia beside Flow-GRPO's own code, on the same tiny pipeline, prompts and noise.

    python benchmarks/peers.py --flow-grpo PATH [--batch 32] [--repeats 3]

``PATH`` is a local clone of github.com/yifan123/flow_grpo (not part of this repository and not needed by
its tests). Its ``pipeline_with_logprob`` (SDE sampling with per-step log-probs) and ``sde_step_with_logprob``
(the step it trains through) are imported from there and run on the quickstart's SD3 pipeline
(``assets/shapes16``, held in gyremedia's ``flow_matching`` backbone: the same transformer object); gyremedia
runs its ``flow_sde`` sampler and ``grpo`` objective on it. Printed:

* **log-prob parity**: Flow-GRPO samples a batch (noise level 0.7, 10 steps, from gyremedia's initial noise);
  gyremedia replays every one of its transitions and scores it: the largest difference of the log-probs;
* **sampling time**: Flow-GRPO's pipeline call against gyremedia's rollout (both decode), the same batch;
* **training step time**: one optimizer step over the first 3 transitions of that batch (Flow-GRPO's
  selection), as Flow-GRPO's training loop computes it (its step function for the log-prob, the clipped ratio
  with clip 1e-4, no KL, written here from its published loss, then backward and AdamW) against
  gyremedia's ``grpo`` objective through ``Trainer.optimize``;

the best of ``--repeats`` timings each, and their ratios (gyremedia / Flow-GRPO). What is not matched:
held-out gains (the recipes are compared by training runs, docs/benchmarks.md), Flow-GRPO's reward servers,
EMA and LoRA loading, and DiffusionNFT's code (not built yet).
"""

from __future__ import annotations

import argparse
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
STEPS, NOISE_LEVEL, TRAINED, CLIP = 10, 0.7, 3, 1e-4


def best_of(repeats: int, function) -> tuple[float, object]:
    """The fastest of ``repeats`` calls and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow-grpo", type=Path, required=True, help="a local clone of yifan123/flow_grpo")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(args.flow_grpo))
    from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob

    pm = PluginManager()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.output_dir={tmp}", "regularizers=[]", "objective.skip_zero_advantage=false",
                     "train.num_minibatches=1", f"rollout.batch_size={args.batch}", "logging.progress=false"]
        trainer = Trainer(resolve_config(load_config(QUICKSTART_GRPO, overrides), pm), pm)
        state = trainer.setup()
        backbone, sampler, pipe = state.backbone, state.sampler, state.backbone.pipeline
        prompts = trainer.rollout_request(0).prompts
        ids = list(range(len(prompts)))
        conditions = backbone.encode(prompts)
        noise = backbone.sample_noise(sample_generators(0, 0, Stream.INITIAL_NOISE, ids))
        size = backbone.generation_arguments()

        def theirs_sample():
            return pipeline_with_logprob(pipe, prompt_embeds=conditions["prompt_embeds"],
                                         pooled_prompt_embeds=conditions["pooled_projections"], latents=noise.clone(),
                                         num_inference_steps=STEPS, guidance_scale=1.0, output_type="pt",
                                         noise_level=NOISE_LEVEL, generator=torch.Generator().manual_seed(0), **size)

        def ours_sample():
            states, log_probs, sigmas = sample_trajectories(
                backbone, sampler, conditions, initial_generators=sample_generators(0, 0, Stream.INITIAL_NOISE, ids),
                step_generators=sample_generators(0, 0, Stream.STEP_NOISE, ids), num_steps=STEPS, guidance_scale=1.0)
            backbone.decode(states[:, -1])
            return states, log_probs, sigmas

        backbone.trainable_module().eval()
        their_time, (_, their_latents, their_log_probs) = best_of(args.repeats, theirs_sample)
        our_time, (_, _, sigmas) = best_of(args.repeats, ours_sample)
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
            torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)

        def ours_train():
            return trainer.optimize(rollout, 0)

        their_step, _ = best_of(args.repeats, theirs_train)
        our_step, _ = best_of(args.repeats, ours_train)
        trainer.scorer.close()

    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), "
          f"{torch.accelerator.current_accelerator() if torch.accelerator.is_available() else 'no accelerator'}")
    print(f"quickstart SD3 pipeline, batch {len(prompts)}, {STEPS} steps, noise level {NOISE_LEVEL}, best of {args.repeats}")
    print(f"log-prob parity on Flow-GRPO's own transitions: max |ours - theirs| = {parity:.2e}")
    print("| part | Flow-GRPO's code | gyremedia | gyremedia / Flow-GRPO |\n|---|---|---|---|")
    print(f"| sampling (with decode) | {their_time:.3f} s | {our_time:.3f} s | {our_time / their_time:.2f}x |")
    print(f"| training step, first {TRAINED} transitions | {their_step:.3f} s | {our_step:.3f} s | "
          f"{our_step / their_step:.2f}x |")
    if not math.isfinite(parity):
        raise SystemExit("log-probs differ: not finite")


if __name__ == "__main__":
    main()
