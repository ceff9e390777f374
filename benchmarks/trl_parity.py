"""gyremedia's token GRPO beside TRL's GRPOTrainer: the same model, prompts and completions.

    pip install -c constraints.txt -e ".[llm]"   # TRL (pinned) and what it needs
    python benchmarks/trl_parity.py [--speed-steps 20]

Parity: one rollout of the llm_quickstart (its model, prompts, completions, rewards and advantages)
goes to both trainers' loss code. For loss types grpo, dapo and dr_grpo, with the KL weight beta at 0
and at 0.04, it prints the largest absolute difference of the first loss, of its gradient, and of the
parameters after 3 steps on that rollout (the old policy's log-probs, recorded before the first step,
are the same tensor for both; with beta > 0 so are the reference's). The 3 steps are plain SGD at the
run's learning rate, which moves each parameter in proportion to its gradient, and AdamW, which does
not: Adam divides each gradient by its own running scale, so a parameter whose gradient is ~0 moves by
about the learning rate in the direction of whatever rounding noise it has (the KL term's gradient is
exactly 0 at the first step in exact arithmetic). Both are reported.

Speed: full steps (generation, reward, update) of both at equal settings (the quickstart's batch,
group size, completion length, temperature, learning rate, beta 0, loss dapo), alternated in one run:
each TRL step is followed by one gyremedia step, inside TRL's own training loop. It prints the ratio
of steps per second (gyremedia / TRL) and where each spends its step.

Ends with one JSON line: max_abs_loss_diff, max_abs_grad_diff, max_abs_param_diff (SGD),
max_abs_param_diff_adamw, steps_per_s_ratio, both step-time breakdowns, and the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from gyremedia.cli import bundled_config
from gyremedia.config import load_config, resolve_config
from gyremedia.objectives.token_grpo import TokenGRPOObjective
from gyremedia.plugins import PluginManager
from gyremedia.trainer import Trainer

LOSS_TYPES, BETAS, PARITY_STEPS = ("grpo", "dapo", "dr_grpo"), (0.0, 0.04), 3


def gyremedia_trainer(run_dir: str, *overrides: str) -> Trainer:
    pm = PluginManager()
    config = resolve_config(load_config(bundled_config("llm_quickstart.yaml"),
                                        [f"run.output_dir={run_dir}", "logging.progress=false", "export.on_train_end=false",
                                         "checkpoint.every=100000", *overrides]), pm)
    trainer = Trainer(config, pm)
    trainer.setup()
    return trainer


def trl_trainer(model_dir: str, prompts: list[str], trainer: Trainer, *, loss_type: str, beta: float, steps: int,
                reward=None, callbacks=()):
    """TRL's GRPOTrainer at the gyremedia run's settings."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    core, backbone = trainer.core, trainer.config.backbone.options
    objective = trainer.config.objective.options
    args = GRPOConfig(
        output_dir=os.path.join(trainer.run_dir, "trl"), report_to="none", save_strategy="no", logging_steps=10**6,
        use_cpu=True, bf16=False, per_device_train_batch_size=core.rollout.batch_size,
        num_generations=core.rollout.group_size, steps_per_generation=1, gradient_accumulation_steps=1,
        max_completion_length=backbone.max_new_tokens, temperature=backbone.temperature, top_p=1.0, top_k=0,
        learning_rate=core.train.learning_rate, adam_beta1=core.train.adam_beta1, adam_beta2=core.train.adam_beta2,
        weight_decay=core.train.weight_decay, max_grad_norm=core.train.max_grad_norm, lr_scheduler_type="constant",
        warmup_steps=0, loss_type=loss_type, beta=beta, epsilon=objective.epsilon,
        epsilon_high=objective.epsilon_high or objective.epsilon, scale_rewards="group", max_steps=steps,
        seed=core.run.seed, disable_dropout=True, shuffle_dataset=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return GRPOTrainer(model=model, reward_funcs=reward or (lambda prompts, completions, **_: [0.0] * len(prompts)),
                       args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                       callbacks=list(callbacks))


def trl_inputs(rollout, reference: torch.Tensor | None) -> dict:
    """A gyremedia rollout in the shape TRL's loss reads."""
    length = rollout.extras["prompt_length"]
    inputs = {"prompt_ids": rollout.states[:, :length], "prompt_mask": rollout.conditions["prompt_mask"],
              "completion_ids": rollout.states[:, length:], "completion_mask": rollout.mask.long(),
              "advantages": rollout.advantages, "old_per_token_logps": rollout.extras["old_log_probs"],
              "num_items_in_batch": rollout.mask.sum()}
    if reference is not None:
        inputs["ref_per_token_logps"] = reference
    return inputs


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def parity(root: str) -> dict[str, float]:
    """Loss, gradient and 3-step parameter differences for every loss type and beta."""
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for loss_type in LOSS_TYPES:
        for beta in BETAS:
            run = os.path.join(root, f"{loss_type}-{beta}")
            ours = gyremedia_trainer(run, f"objective.loss_type={loss_type}", f"objective.kl_beta={beta}",
                                     f"train.num_iterations={PARITY_STEPS}", "train.max_grad_norm=1e9")
            state = ours.state
            rollout = ours.collect_rollout(0)
            ours.score(rollout, 0)
            ours.compute_advantages(rollout, 0)
            ctx_kwargs = dict(backbone=state.backbone, sampler=None, guidance_scale=1.0, step=0, accelerator=ours.accelerator,
                              minibatches=1, passes=PARITY_STEPS)
            from gyremedia.interfaces import ObjectiveContext

            ctx = ObjectiveContext(**ctx_kwargs)
            objective: TokenGRPOObjective = state.objective
            objective.prepare(ctx, rollout)
            reference = state.backbone.token_log_probs(rollout, reference=True) if beta else None
            theirs = trl_trainer(state.config.backbone.options.pretrained, rollout.prompts, ours, loss_type=loss_type,
                                 beta=beta, steps=PARITY_STEPS)
            theirs.model.train()
            theirs.current_gradient_accumulation_steps = 1
            inputs = trl_inputs(rollout, reference)
            our_model = state.backbone.trainable_module()
            start = {k: v.detach().clone() for k, v in our_model.state_dict().items()}
            for optimizer in ("sgd", "adamw"):
                our_model.load_state_dict(start)
                theirs.model.load_state_dict(start)
                ours_step, theirs_step = make_optimizer(optimizer, our_model, ours), make_optimizer(optimizer, theirs.model, ours)
                for k in range(PARITY_STEPS):
                    out = objective.loss(ctx, rollout, 0)
                    loss = out.loss
                    if beta:
                        loss = loss + beta * state.regularizers["token_kl"](state=state, rollout=rollout,
                                                                            outputs=out.outputs).loss
                    ours_step.zero_grad()
                    loss.backward()
                    their_loss = theirs._compute_loss(theirs.model, inputs)
                    theirs_step.zero_grad()
                    their_loss.backward()
                    if k == 0 and optimizer == "sgd":
                        worst["loss"] = max(worst["loss"], abs(float(loss) - float(their_loss)))
                        worst["grad"] = max(worst["grad"], max_diff(gradients(our_model), gradients(theirs.model)))
                        print(f"{loss_type:8} beta={beta:<5} loss {float(loss):+.9f} (TRL {float(their_loss):+.9f})",
                              flush=True)
                    ours_step.step()
                    theirs_step.step()
                params = max_diff(dict(our_model.named_parameters()), dict(theirs.model.named_parameters()))
                key = "param" if optimizer == "sgd" else "adam_param"
                worst[key] = max(worst.get(key, 0.0), params)
                print(f"{'':8} after {PARITY_STEPS} {optimizer} steps: max |param diff| {params:.2e}", flush=True)
    return worst


def make_optimizer(kind: str, model: torch.nn.Module, trainer: Trainer) -> torch.optim.Optimizer:
    train = trainer.core.train
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=train.learning_rate)
    return torch.optim.AdamW(model.parameters(), lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2),
                             weight_decay=train.weight_decay)


def speed(root: str, steps: int) -> dict[str, float]:
    """Steps per second of both at equal settings, alternated step by step in one run (TRL's loop drives)."""
    from transformers import TrainerCallback

    from gyremedia_text.task import is_correct

    ours = gyremedia_trainer(os.path.join(root, "speed"), "objective.kl_beta=0", "objective.loss_type=dapo")
    timings = {"trl": [], "gyremedia": [], "gyremedia_parts": []}

    class Alternate(TrainerCallback):
        """After each TRL step, one gyremedia step; each timed on its own."""

        def __init__(self) -> None:
            self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["trl"].append(time.perf_counter() - self.mark)
            start = time.perf_counter()
            metrics = ours.train_step(len(timings["gyremedia"]))
            timings["gyremedia"].append(time.perf_counter() - start)
            timings["gyremedia_parts"].append({k: metrics[k] for k in ("time/rollout", "time/reward", "time/train")})
            self.mark = time.perf_counter()

    prompts = ours.prompts.prompts

    def reward(prompts, completions, **_):
        return [float(is_correct(p, c)) for p, c in zip(prompts, completions)]

    theirs = trl_trainer(ours.config.backbone.options.pretrained, prompts, ours, loss_type="dapo", beta=0.0,
                         steps=steps + 1, reward=reward, callbacks=[Alternate()])
    generation = theirs._generate_and_score_completions  # TRL's generation, rewards, advantages and log-probs

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = generation(*args, **kwargs)
        timings["trl_generate"].append(time.perf_counter() - start)
        return out

    timings["trl_generate"] = []
    theirs._generate_and_score_completions = timed
    theirs.train()
    trl, gyre = timings["trl"][1:], timings["gyremedia"][1:]  # the first step of each pays for warm-up
    parts = {k: sum(p[k] for p in timings["gyremedia_parts"][1:]) / len(gyre) for k in timings["gyremedia_parts"][0]}
    trl_generate = sum(timings["trl_generate"][1:len(trl) + 1]) / len(trl)
    trl_step = sum(trl) / len(trl)
    print(f"step seconds: TRL {trl_step:.3f} (generate+score {trl_generate:.3f}, update {trl_step - trl_generate:.3f}), "
          f"gyremedia {sum(gyre) / len(gyre):.3f} (rollout {parts['time/rollout']:.3f}, reward {parts['time/reward']:.3f}, "
          f"update {parts['time/train']:.3f})")
    return {"trl_steps_per_s": len(trl) / sum(trl), "gyremedia_steps_per_s": len(gyre) / sum(gyre),
            "trl_generate_and_score_s": trl_generate, "trl_update_s": trl_step - trl_generate,
            **{f"gyremedia_{k.split('/')[1]}_s": v for k, v in parts.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed-steps", type=int, default=20)
    parser.add_argument("--out", default="runs/trl_parity")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    worst = parity(args.out)
    timing = speed(args.out, args.speed_steps)
    import trl

    print(json.dumps({"max_abs_loss_diff": worst["loss"], "max_abs_grad_diff": worst["grad"],
                      "max_abs_param_diff": worst["param"], "max_abs_param_diff_adamw": worst["adam_param"],
                      "steps_per_s_ratio": timing["gyremedia_steps_per_s"] / timing["trl_steps_per_s"], **timing,
                      "trl": trl.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(),
                      "hardware": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
