"""gyremedia's token GRPO beside TRL's GRPOTrainer: the same model, prompts, settings and completions.

    pip install -c constraints.txt -e ".[llm]"   # TRL (pinned) and what it needs
    python benchmarks/trl_parity.py [--speed-steps 20] [--replica-steps 1] [--sizes quickstart replica]
                                    [--checkpointing off on] [--no-parity]

Parity: one rollout of the llm_quickstart (its model, prompts, completions and rewards) goes to both trainers.
TRL sees it through its own ``_generate_and_score_completions``, its generation alone replaced by the rollout's
ids (and, for TIS / MIS, the sampler's log-probs), so its own code takes the old policy's log-probs, the
reference's, the importance weights and the advantages. Cases: loss types grpo, bnpo, dr_grpo and dapo with the
KL weight beta at 0 and 0.04, and dapo with TIS and MIS (gyremedia's ``importance_correction: tis | mis`` against
TRL's ``vllm_importance_sampling_mode: token_truncate | token_mask``, both capped at 2). TRL computes those weights
only under vLLM, so ``use_vllm`` is set on the built trainer (nothing of vLLM runs: generation is replaced), and
the sampler's log-probs are the rollout's plus Gaussian noise (one CPU engine samples and trains, so they agree to
~1e-6 and no cap would bite). Per case it prints the largest absolute difference of the loss and of its gradient
over 3 SGD steps on the rollout, and of the parameters after them and after 3 AdamW steps, with the share of
tokens whose clip bites at the last step; for TIS / MIS also the largest difference of the weights (each side's
from its own forward: they differ as the old log-probs do, ~1e-5) and the share of tokens over the cap (TRL's ``clip_ratio/region_mean``): SGD runs at 0.02 and AdamW at the
quickstart's 1e-4, both far enough for the ratio to leave the clip range, not so far that gyremedia's bound on the
KL's k3 (10 per token, verl's; TRL has none) is reached (SGD at 0.05 reaches 23). Adam divides each gradient by its own
running scale, so a parameter whose gradient is ~0 moves by about the learning rate in the direction of its
rounding noise (the KL term's gradient is exactly 0 at the first step): its parameter difference is not a
parity figure.

KL: TRL 1.16 multiplies each token's k3 by its ratio pi_theta / pi_old by default (``use_bias_correction_kl``,
DeepSeek-V3.2's unbiased reverse-KL gradient); gyremedia's ``token_kl`` has no such option, so TRL runs with it
off. (Left on, the losses part from the second step on: the k3 is 0 at the first.)

Advantages: TRL's ``scale_rewards="group"`` divides by the group's std with Bessel's correction, gyremedia's
``advantage.std: group`` by the population std, so TRL's are gyremedia's x sqrt((G - 1) / G) (0.935 for groups
of 8; printed, from TRL's own advantages). The losses are compared on gyremedia's advantages; in the race each
trainer keeps its own (the scale changes no step's cost).

Race: full steps (generation, reward, update) of each trainer in its own process, at equal settings (the
quickstart's batch, group size, temperature, learning rate, beta 0, loss dapo, fp32), with gradient checkpointing
off on both sides and on on both sides (GRPOConfig turns it on by default), at two sizes: the quickstart's model
(5 new tokens, 128 rows) and a 1-layer Llama with Qwen2's 151,936-token vocabulary at 256 new tokens (16 rows;
``benchmarks/token_memory.py``'s replica). It prints the median step's seconds and where each spends it, steps per
second, and the process's peak resident set over the steps (VmHWM, reset just before the first step) with its
growth over the loaded model. Memory comes from a second, 2-step run of each with ``MALLOC_MMAP_THRESHOLD_=65536``
(the resident set then follows the live tensors, but every allocation costs a system call, which halved
gyremedia's steps per second at the quickstart's size), time from a run with the allocator as users have it. The
first step of each (warm-up, AdamW's states) counts for memory, not for time. The replica's random model
earns no reward (every advantage 0), which changes no step's cost. By default 20 timed steps at the quickstart's
size and 1 at the replica's, where a step takes the better part of a minute on 2 CPU cores.

Ends with one JSON line: max_abs_loss_diff, max_abs_grad_diff, max_abs_param_diff (SGD),
max_abs_param_diff_adamw, max_abs_is_weight_diff, steps_per_s_ratio (the quickstart, checkpointing off on both
sides), gradient_checkpointing (each side's setting behind that ratio, read from its model), the race's rows, and
the hardware.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gyremedia.cli import bundled_config
from gyremedia.config import load_config, resolve_config
from gyremedia.interfaces import ObjectiveContext
from gyremedia.objectives.token_grpo import TokenGRPOObjective
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

LOSS_TYPES, BETAS, PARITY_STEPS = ("grpo", "bnpo", "dr_grpo", "dapo"), (0.0, 0.04), 3
#: gyremedia's importance_correction -> TRL's vllm_importance_sampling_mode (per token, both above the cap)
CORRECTIONS = {"tis": "token_truncate", "mis": "token_mask"}
CASES = [(t, b, "none") for t in LOSS_TYPES for b in BETAS] + [("dapo", 0.0, c) for c in CORRECTIONS]
CORRECTION_CAP, SAMPLER_NOISE = 2.0, 0.5  # exp(-0.5 x N(0, 1)) passes 2 for 8% of the tokens
PARITY_LR = {"sgd": 0.02, "adamw": 1e-4}  # the clip bites; the KL's k3 stays under its bound of 10
#: race sizes: the quickstart's own settings, and the real-vocabulary replica
SIZES = {"quickstart": (), "replica": ("backbone.max_new_tokens=256", "rollout.batch_size=16")}
REPLICA_VOCABULARY = 151_936
GiB = 2**30


def gyremedia_trainer(run_dir: str, *overrides: str, setup: bool = True) -> Trainer:
    """The llm_quickstart's trainer with ``overrides``; ``setup=False`` reads its settings without loading a model."""
    pm = PluginManager()
    config = resolve_config(
        load_config(
            bundled_config("llm_quickstart.yaml"),
            [
                f"run.output_dir={run_dir}",
                "logging.progress=false",
                "export.on_train_end=false",
                "checkpoint.every=100000",
                *overrides,
            ],
        ),
        pm,
    )
    trainer = Trainer(config, pm)
    if setup:
        trainer.setup()
    return trainer


def trl_trainer(
    prompts: list[str],
    trainer: Trainer,
    *,
    loss_type: str,
    beta: float,
    steps: int,
    num_iterations: int = 1,
    gradient_checkpointing: bool = False,
    correction: str = "none",
    reward=None,
    callbacks=(),
):
    """TRL's GRPOTrainer at the gyremedia run's settings (``trainer`` need not be set up)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    core, backbone = trainer.core, trainer.config.backbone.options
    objective = trainer.config.objective.options
    args = GRPOConfig(
        output_dir=os.path.join(trainer.run_dir, "trl"),
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=core.rollout.batch_size,
        num_generations=core.rollout.group_size,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=num_iterations,
        gradient_checkpointing=gradient_checkpointing,
        max_completion_length=backbone.max_new_tokens,
        temperature=backbone.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=core.train.learning_rate,
        adam_beta1=core.train.adam_beta1,
        adam_beta2=core.train.adam_beta2,
        weight_decay=core.train.weight_decay,
        max_grad_norm=core.train.max_grad_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        loss_type=loss_type,
        beta=beta,
        use_bias_correction_kl=False,
        epsilon=objective.epsilon,
        epsilon_high=objective.epsilon_high or objective.epsilon,
        scale_rewards="group",
        max_steps=steps,
        seed=core.run.seed,
        disable_dropout=True,
        shuffle_dataset=True,
        vllm_importance_sampling_correction=correction != "none",
        vllm_importance_sampling_mode=CORRECTIONS.get(correction, "token_truncate"),
        vllm_importance_sampling_clip_max=objective.correction_cap,
        vllm_importance_sampling_clip_min=None,
    )
    tokenizer = AutoTokenizer.from_pretrained(backbone.pretrained)
    model = AutoModelForCausalLM.from_pretrained(backbone.pretrained, dtype=torch.float32)
    return GRPOTrainer(
        model=model,
        reward_funcs=reward or (lambda prompts, completions, **_: [0.0] * len(prompts)),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


def trl_batch(theirs, rollout, sampler_log_probs: torch.Tensor | None) -> dict:
    """The rollout through TRL's own ``_generate_and_score_completions`` (its old, reference and sampler log-probs,
    importance weights and advantages), its generation replaced by the rollout's ids and ``sampler_log_probs``."""
    length = rollout.prompt_length
    prompt_mask, mask = rollout.conditions["prompt_mask"].bool(), rollout.mask.bool()
    prompt_ids = [row[keep].tolist() for row, keep in zip(rollout.states[:, :length], prompt_mask)]
    completion_ids = [row[keep].tolist() for row, keep in zip(rollout.states[:, length:], mask)]
    sampled = None if sampler_log_probs is None else [row[keep].tolist() for row, keep in zip(sampler_log_probs, mask)]
    completions = theirs.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    theirs._generate = lambda prompts: (prompt_ids, completion_ids, None, completions, sampled, {}, None, [])
    theirs.use_vllm = sampler_log_probs is not None  # TRL weighs by the sampler's log-probs only under vLLM
    theirs.model.train()
    return theirs._generate_and_score_completions([{"prompt": p} for p in rollout.prompts])


def fixed_rewards(values: list[float]):
    """A TRL reward function giving ``values``: the gyremedia rollout's rewards, in the rollout's order."""
    return lambda prompts, completions, **_: values


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k] - b[k]).detach().abs().max()) for k in a)


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


def make_optimizer(kind: str, model: torch.nn.Module, trainer: Trainer) -> torch.optim.Optimizer:
    train = trainer.core.train
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=PARITY_LR["sgd"])
    return torch.optim.AdamW(
        model.parameters(),
        lr=PARITY_LR["adamw"],
        betas=(train.adam_beta1, train.adam_beta2),
        weight_decay=train.weight_decay,
    )


def parity(root: str) -> dict[str, float]:
    """Loss, gradient and 3-step parameter differences for every case; the advantage scales once."""
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "adam_param": 0.0, "old_log_prob": 0.0, "is_weight": 0.0}
    for loss_type, beta, correction in CASES:
        run = os.path.join(root, f"{loss_type}-{beta}-{correction}")
        ours = gyremedia_trainer(
            run,
            f"objective.loss_type={loss_type}",
            f"objective.kl_beta={beta}",
            f"objective.importance_correction={correction}",
            f"objective.correction_cap={CORRECTION_CAP}",
            f"train.num_iterations={PARITY_STEPS}",
            "train.max_grad_norm=1e9",
        )
        state = ours.state
        rollout = ours.collect_rollout(0)
        ours.score(rollout, 0)
        ours.compute_advantages(rollout, 0)
        sampler = None
        if correction != "none":  # an engine that disagrees with the trainer: what TIS / MIS correct
            noise = torch.randn(rollout.log_probs.shape, generator=torch.Generator().manual_seed(0))
            sampler = rollout.log_probs = torch.where(
                rollout.mask.bool(), rollout.log_probs + SAMPLER_NOISE * noise, 0.0
            )
        ctx = ObjectiveContext(
            backbone=state.backbone,
            sampler=None,
            guidance_scale=1.0,
            step=0,
            accelerator=ours.accelerator,
            minibatches=1,
            passes=PARITY_STEPS,
        )
        objective: TokenGRPOObjective = state.objective
        objective.prepare(ctx, rollout)
        theirs = trl_trainer(
            rollout.prompts,
            ours,
            loss_type=loss_type,
            beta=beta,
            steps=PARITY_STEPS,
            num_iterations=PARITY_STEPS,
            correction=correction,
            reward=fixed_rewards(rollout.reward.tolist()),
        )
        theirs.current_gradient_accumulation_steps = 1
        inputs = trl_batch(theirs, rollout, sampler)
        mask = rollout.mask.float()
        worst["old_log_prob"] = max(
            worst["old_log_prob"], masked_max_diff(inputs["old_per_token_logps"], rollout.extras["old_log_probs"], mask)
        )
        if (loss_type, beta, correction) == CASES[0]:
            advantage_scales(inputs["advantages"], rollout.advantages, ours.core.rollout.group_size)
        inputs["advantages"] = rollout.advantages  # the losses are compared on the same advantages
        line = f"{loss_type:8} beta={beta:<5}" + (
            f" {correction.upper()} (TRL {CORRECTIONS[correction]})" if correction != "none" else ""
        )
        if correction != "none":
            weights = rollout.extras["is_weights"]
            ratio = torch.exp(rollout.extras["old_log_probs"] - sampler)
            capped = float(((ratio > CORRECTION_CAP).float() * mask).sum() / mask.sum())
            is_diff = masked_max_diff(inputs["importance_sampling_ratio"], weights, mask)
            worst["is_weight"] = max(worst["is_weight"], is_diff)
            line += f"  weights: max |diff| {is_diff:.1e}, {capped:.1%} of tokens over the cap"
        print(line, flush=True)
        our_model = state.backbone.trainable_module()
        start = {k: v.detach().clone() for k, v in our_model.state_dict().items()}
        for optimizer in ("sgd", "adamw"):
            our_model.load_state_dict(start)
            theirs.model.load_state_dict(start)
            ours_step, theirs_step = (
                make_optimizer(optimizer, our_model, ours),
                make_optimizer(optimizer, theirs.model, ours),
            )
            loss_diff = grad_diff = 0.0
            for _ in range(PARITY_STEPS):
                out = objective.loss(ctx, rollout, 0)
                loss = out.loss
                if beta:
                    loss = (
                        loss
                        + beta * state.regularizers["token_kl"](state=state, rollout=rollout, outputs=out.outputs).loss
                    )
                ours_step.zero_grad()
                loss.backward()
                their_loss = theirs._compute_loss(theirs.model, inputs)
                theirs_step.zero_grad()
                their_loss.backward()
                loss_diff = max(loss_diff, abs(float(loss.detach()) - float(their_loss.detach())))
                grad_diff = max(grad_diff, max_diff(gradients(our_model), gradients(theirs.model)))
                ours_step.step()
                theirs_step.step()
            params = max_diff(dict(our_model.named_parameters()), dict(theirs.model.named_parameters()))
            bites = theirs._metrics["train"]["clip_ratio/region_mean"][-1]  # at the last step
            if optimizer == "sgd":
                worst.update(
                    loss=max(worst["loss"], loss_diff),
                    grad=max(worst["grad"], grad_diff),
                    param=max(worst["param"], params),
                )
                print(
                    f"{'':8} sgd lr {PARITY_LR['sgd']}: max |diff| loss {loss_diff:.1e}, gradient {grad_diff:.1e}, "
                    f"params after {PARITY_STEPS} steps {params:.1e}; clip bites on {bites:.1%}",
                    flush=True,
                )
            else:
                worst["adam_param"] = max(worst["adam_param"], params)
                print(
                    f"{'':8} adamw lr {PARITY_LR['adamw']}: max |param diff| after {PARITY_STEPS} steps {params:.1e}; "
                    f"clip bites on {bites:.1%}",
                    flush=True,
                )
    print(f"old policy's log-probs, TRL's forward against gyremedia's: max |diff| {worst['old_log_prob']:.1e}")
    return worst


def advantage_scales(theirs: torch.Tensor, ours: torch.Tensor, group: int) -> None:
    """Print how TRL's advantages compare with gyremedia's from the same rewards (Bessel's correction or not)."""
    moved = ours.abs() > 1e-3
    ratio = theirs[moved] / ours[moved]
    print(
        f"advantages from the same rewards, TRL / gyremedia: {float(ratio.min()):.4f} to {float(ratio.max()):.4f} "
        f"(sqrt({group - 1}/{group}) = {math.sqrt((group - 1) / group):.4f}: TRL's scale_rewards=group divides by "
        f"the std with Bessel's correction, gyremedia's advantage.std=group by the population std)"
    )


def checkpointed(model: torch.nn.Module) -> bool:
    """Whether transformers' gradient checkpointing is on anywhere in ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def worker(spec: dict) -> dict:
    """One trainer's race at one size and checkpointing setting, in this process: its step times and peak RSS."""
    from memory import make_probe, rss  # benchmarks/memory.py

    probe, _ = make_probe()
    steps = spec["steps"] + 1  # the first warms up
    overrides = [
        *spec["overrides"],
        f"backbone.gradient_checkpointing={spec['checkpointing']}",
        "objective.kl_beta=0",
        "objective.loss_type=dapo",
        f"train.steps={steps}",
    ]
    times, parts = [], []
    if spec["side"] == "gyremedia":
        ours = gyremedia_trainer(spec["run_dir"], *overrides)
        baseline = rss()
        probe.reset()
        for step in range(steps):
            start = time.perf_counter()
            metrics = ours.train_step(step)
            times.append(time.perf_counter() - start)
            parts.append({k.split("/")[1]: metrics[k] for k in ("time/rollout", "time/reward", "time/train")})
        model = ours.state.backbone.trainable_module()
    else:
        from transformers import TrainerCallback

        from gyremedia_text.task import is_correct

        class Clock(TrainerCallback):
            """Each step's seconds, from just before the first (when the peak is reset too)."""

            def on_train_begin(self, args, state, control, **kwargs):
                self.baseline = rss()
                probe.reset()
                self.mark = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                times.append(time.perf_counter() - self.mark)
                parts[-1]["update"] = times[-1] - parts[-1]["generate+score"]
                self.mark = time.perf_counter()

        def reward(prompts, completions, **_):
            return [float(is_correct(p, c)) for p, c in zip(prompts, completions)]

        settings = gyremedia_trainer(spec["run_dir"], *overrides, setup=False)
        clock = Clock()
        theirs = trl_trainer(
            settings.prompts.prompts,
            settings,
            loss_type="dapo",
            beta=0.0,
            steps=steps,
            gradient_checkpointing=spec["checkpointing"],
            reward=reward,
            callbacks=[clock],
        )
        generation = theirs._generate_and_score_completions  # TRL's generation, rewards, advantages and log-probs

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = generation(*args, **kwargs)
            parts.append({"generate+score": time.perf_counter() - start})
            return out

        theirs._generate_and_score_completions = timed
        theirs.train()
        baseline, model = clock.baseline, theirs.model
    median = statistics.median(times[1:])
    return {
        "step_s": median,
        "steps_per_s": 1 / median,
        "checkpointing": checkpointed(model),
        "parts": {k: statistics.median(p[k] for p in parts[1:]) for k in parts[0]},
        "peak_gib": probe.peak() / GiB,
        "growth_gib": (probe.peak() - baseline) / GiB,
    }


def race(root: str, sizes: list[str], settings: list[str], steps: dict[str, int]) -> list[dict]:
    """Every size x checkpointing setting x trainer, each in its own process."""
    from token_memory import build_model  # benchmarks/token_memory.py

    # memory in a run of its own, with glibc mapping every buffer of 64 KiB or more on its own so the resident set
    # follows the live tensors; that costs every allocation a system call (it halved gyremedia's quickstart steps
    # per second and TRL's by a third), so the steps per second come from a run with the allocator as users have it
    envs = {"speed": dict(os.environ), "memory": dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            overrides = list(SIZES[size])
            if size == "replica":
                model = Path(tmp) / "replica"
                build_model(model, REPLICA_VOCABULARY)
                overrides.append(f"backbone.pretrained={model}")
            for setting in settings:
                row = {"size": size, "gradient_checkpointing": setting == "on"}
                # who goes first alternates, so a load that rises or falls over the run favours neither
                for side in ("gyremedia", "trl")[:: 1 if len(rows) % 2 == 0 else -1]:
                    measured = {}
                    for kind, env in envs.items():
                        spec = {
                            "side": side,
                            "overrides": overrides,
                            "checkpointing": setting == "on",
                            "steps": steps[size] if kind == "speed" else min(steps[size], 2),
                            "run_dir": os.path.join(root, f"race-{size}-{setting}-{side}-{kind}"),
                        }
                        done = subprocess.run(
                            [sys.executable, __file__, "--worker", json.dumps(spec)],
                            env=env,
                            capture_output=True,
                            text=True,
                            check=False,
                        )
                        if done.returncode:
                            sys.exit(f"{side} at {size}, checkpointing {setting}, failed:\n{done.stderr[-4000:]}")
                        measured[kind] = json.loads(done.stdout.splitlines()[-1])
                    row[side] = {
                        **measured["speed"],
                        "peak_gib": measured["memory"]["peak_gib"],
                        "growth_gib": measured["memory"]["growth_gib"],
                    }
                    assert row[side]["checkpointing"] == row["gradient_checkpointing"], (side, row)
                row["steps_per_s_ratio"] = row["gyremedia"]["steps_per_s"] / row["trl"]["steps_per_s"]
                row["peak_ratio"] = row["gyremedia"]["peak_gib"] / row["trl"]["peak_gib"]
                print_row(row)
                rows.append(row)
    return rows


def print_row(row: dict) -> None:
    theirs, ours = row["trl"], row["gyremedia"]
    met = row["steps_per_s_ratio"] >= 1.3 and ours["peak_gib"] <= theirs["peak_gib"]
    print(
        f"{row['size']:10} checkpointing {'on ' if row['gradient_checkpointing'] else 'off'}  "
        f"steps/s TRL {theirs['steps_per_s']:7.3f}  gyremedia {ours['steps_per_s']:7.3f}  "
        f"ratio {row['steps_per_s_ratio']:.2f}x  |  peak GiB (growth) TRL {theirs['peak_gib']:.2f} "
        f"({theirs['growth_gib']:+.2f})  gyremedia {ours['peak_gib']:.2f} ({ours['growth_gib']:+.2f})  "
        f"{'meets' if met else 'MISSES'} 1.3x and no more memory",
        flush=True,
    )
    print(
        f"{'':10} median step s: TRL {theirs['step_s']:.3f} ("
        + ", ".join(f"{k} {v:.3f}" for k, v in theirs["parts"].items())
        + f"), gyremedia {ours['step_s']:.3f} ("
        + ", ".join(f"{k} {v:.3f}" for k, v in ours["parts"].items())
        + ")",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed-steps", type=int, default=20, help="timed steps per trainer at the quickstart size")
    parser.add_argument("--replica-steps", type=int, default=1, help="timed steps per trainer at the replica size")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--no-parity", action="store_true", help="the race alone")
    parser.add_argument("--out", default="runs/trl_parity")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one trainer's race, in a child process
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    worst = {} if args.no_parity else parity(args.out)
    rows = race(
        args.out, args.sizes, args.checkpointing, {"quickstart": args.speed_steps, "replica": args.replica_steps}
    )
    headline = next((r for r in rows if r["size"] == "quickstart" and not r["gradient_checkpointing"]), None)
    import trl

    print(
        json.dumps(
            {
                "max_abs_loss_diff": worst.get("loss"),
                "max_abs_grad_diff": worst.get("grad"),
                "max_abs_param_diff": worst.get("param"),
                "max_abs_param_diff_adamw": worst.get("adam_param"),
                "max_abs_is_weight_diff": worst.get("is_weight"),
                "steps_per_s_ratio": headline and headline["steps_per_s_ratio"],
                "gradient_checkpointing": headline
                and {side: headline[side]["checkpointing"] for side in ("gyremedia", "trl")},
                "race": rows,
                "trl": trl.__version__,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
