"""The training loop, on an accelerate ``Accelerator`` (one process or many).

One step: sample a rollout -> decode to media -> score with the selected rewards -> group-relative
advantages over all ranks -> objective (+ regularizers) per micro-step with gradient accumulation
-> one optimizer step per minibatch -> metrics, hooks, checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gyremedia import checkpoint as ckpt
from gyremedia import evaluation, sharding
from gyremedia.advantages import PromptStatTracker, distributed_group_advantages
from gyremedia.candidates import contrastive_subset
from gyremedia.config import ConfigError, ResolvedConfig
from gyremedia.distributed import average_gradients, global_nanmeans, host_floats, means_over_ranks, raise_together
from gyremedia.interfaces import BuildContext, LossOutput, ObjectiveContext, RolloutRequest
from gyremedia.plugins import PluginManager, call_each
from gyremedia.media_io import plot_metrics, plot_pareto_front
from gyremedia.monitor import HackingMonitor
from gyremedia.rollout import Rollout
from gyremedia.sampling import KeptForwards, stochastic_steps
from gyremedia.state import TrainState
from gyremedia.runs import CHANGES_FILE, EXPORT_DIR, RESOLVED_CONFIG, check_resumed_settings, export_whole
from gyremedia.scoring import RewardError, Scorer, reward_error  # noqa: F401 - RewardError is part of the API
from gyremedia.streams import Stream, stream_rng

logger = logging.getLogger("gyremedia")


class NonFiniteLoss(RuntimeError):
    """A loss term or the gradient was NaN or inf: the run stopped before that update."""

    exit_code = 1

    def __init__(self, step: int, terms: list[str], last_checkpoint: int | None) -> None:
        saved = (f"the last checkpoint ({ckpt.checkpoint_name(last_checkpoint)}) holds finite weights"
                 if last_checkpoint is not None else "no checkpoint was written yet")
        super().__init__(f"step {step}: {', '.join(terms)} not finite; the run stopped before this update, so {saved}: "
                         "lower train.learning_rate or train.max_grad_norm, or set train.on_nonfinite=skip to drop such "
                         "updates")
        self.step, self.terms = step, terms


class Interrupted(RuntimeError):
    """A SIGTERM or SIGINT ended the run after a checkpoint; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: Path, run_dir: Path) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"{name} received: stopped after step {step} with checkpoint {checkpoint}; continue with "
                         f"`gyremedia train --resume {run_dir}`")
        self.exit_code = 128 + signum


def _create_accelerator():
    from accelerate import Accelerator

    # Without an accelerator device, accelerate runs several launched processes as gloo ranks
    # (MULTI_CPU) only when told to use the CPU.
    return Accelerator(cpu=not torch.accelerator.is_available())


def check_process_layout(config: ResolvedConfig, num_processes: int) -> None:
    """Batch-size constraints that depend on the number of processes (checked before models load)."""
    rollout, train = config.core.rollout, config.core.train
    if rollout.batch_size % num_processes:
        raise ConfigError(
            f"rollout.batch_size={rollout.batch_size} is not divisible by the {num_processes} processes: "
            f"use a multiple of {num_processes}"
        )
    per_rank = rollout.batch_size // num_processes
    if per_rank % train.num_minibatches:
        raise ConfigError(
            f"each process holds {per_rank} samples, not divisible by train.num_minibatches={train.num_minibatches}"
        )
    if rollout.candidates and per_rank % rollout.group_size:
        raise ConfigError(
            f"candidate selection ranks each group's candidates on one process: make rollout.batch_size / processes "
            f"= {per_rank} a multiple of rollout.group_size={rollout.group_size}"
        )
    if rollout.branch_steps and (per_rank // train.num_minibatches) % rollout.group_size:
        raise ConfigError(
            f"tree rollouts keep each group whole in one minibatch on one process: make rollout.batch_size / "
            f"(processes x train.num_minibatches) = {per_rank // train.num_minibatches} a multiple of "
            f"rollout.group_size={rollout.group_size}"
        )


def resolve_sharding(config: ResolvedConfig, accelerator: Any, plugins: PluginManager) -> bool:
    """Whether this run shards its model (``train.sharding``; ``auto`` follows an accelerate FSDP launch), checked
    before any model loads. Refuses processes that were launched together but each run alone."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        raise ConfigError(
            f"{launched} processes were launched but each runs alone (accelerate sees {accelerator.num_processes}): "
            "every one would train its own copy of the model; launch with `accelerate launch --multi_gpu "
            "--num_processes N` or a config from configs/accelerate/")
    launch = getattr(accelerator.distributed_type, "value", "")
    if launch == "DEEPSPEED":
        # DeepSpeed steps its optimizer inside backward, which breaks the accumulation over an objective's micro-steps
        raise ConfigError("DeepSpeed launches are not supported: shard with FSDP2 instead "
                          "(accelerate launch --config_file configs/accelerate/fsdp2.yaml, or train.sharding=fsdp2)")
    choice = config.core.train.sharding
    # without an accelerator device accelerate turns an FSDP launch into plain gloo processes; its flag stays
    fsdp_launch = launch == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if choice == "none" and launch == "FSDP":
        # accelerate.prepare would shard the model itself, behind the trainer's back
        raise ConfigError("train.sharding=none on an FSDP launch: launch with configs/accelerate/ddp.yaml to train "
                          "unsharded, or leave train.sharding at auto")
    if choice == "none" or (choice == "auto" and not fsdp_launch):
        return False
    backbone = config.backbone.name
    if not plugins.component("backbone", backbone).meta.get("shardable"):
        raise ConfigError(f"train.sharding={choice}: backbone {backbone!r} cannot be sharded (its processes do not "
                          "run the same model calls in a step): use train.sharding=none and a DDP launch "
                          "(configs/accelerate/ddp.yaml)")
    if accelerator.num_processes == 1:
        logger.info("train.sharding=%s with one process: nothing to shard", choice)
        return False
    return True


#: Steps over which a reward's share of dropped samples is measured against its ``max_dropped``.
DROP_WINDOW = 10

#: Device types with PyTorch's fused AdamW kernel (torch checks only at the first step, so it is decided here).
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


def adamw(params: list[torch.nn.Parameter], fused: bool, **options: Any) -> torch.optim.AdamW:
    """AdamW; with ``fused``, its fused kernel where every parameter's device has it (``train.fused_adamw``),
    else the default implementation."""
    fused = fused and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **options)


def preference_weights(seed: int, step: int, group_ids: torch.Tensor, count: int, concentration: float) -> torch.Tensor:
    """``[B, count]`` reward-preference weights, one Dirichlet draw per group keyed by ``(seed, step, group)``
    (the same on any number of processes)."""
    rows = {g: stream_rng(seed, step, Stream.PREFERENCE, g).dirichlet([concentration] * count)
            for g in group_ids.unique().tolist()}
    return torch.tensor(np.stack([rows[g] for g in group_ids.tolist()]), dtype=torch.float32)


class Trainer:
    """Builds the selected components and runs the loop; ``Trainer(config, pm).train()``."""

    def __init__(self, config: ResolvedConfig, plugins: PluginManager, *, resume: bool = False,
                 override_resumed: list[str] | tuple[str, ...] = (), accelerator: Any = None) -> None:
        self.config = config
        self.core = config.core
        self.accelerator = accelerator or _create_accelerator()
        check_process_layout(config, self.accelerator.num_processes)
        self.sharded = resolve_sharding(config, self.accelerator, plugins)
        train = self.core.train
        self.reuse_forwards = self._unless_sharded("reuse_rollout_forward", train.reuse_rollout_forward,
                                                   "a sharded model gathers its weights per forward and frees them "
                                                   "after; training replays every transition")
        self.run_dir = Path(self.core.run.output_dir)
        self.resume = resume
        self._refuse_to_overwrite()
        if resume:
            self._check_resumed_settings(override_resumed)
        self.state = TrainState(config=config, accelerator=self.accelerator, run_dir=self.run_dir, plugins=plugins)
        self.prompts = evaluation.training_prompts(config)
        # With async scoring: the next step's rollout, sampled and being scored. Not checkpointed: a
        # resumed run samples it again with the restored policy.
        self._pending: dict[int, tuple[Rollout, dict[str, Any], float]] = {}
        self._group_prompts: dict[int, list[str]] = {}  # drawn once per step (see group_prompts)
        self._base_metrics: dict[str, float] | None = None  # the step-0 evaluation (not kept across a resume)
        self._last_save: tuple[int, float] | None = None  # (step, monotonic time) of the last checkpoint
        self._nonfinite_skipped = 0
        self._eval_scores: dict[int, dict[str, torch.Tensor]] = {}  # per-sample scores at step 0 and the last step
        self._signal: int | None = None  # the first SIGTERM / SIGINT received
        self._dropped: dict[str, collections.deque] = {}  # each dropping reward's counts over the last steps
        self._finishing = False  # every step done: plotting and exporting

    # ------------------------------------------------------------------ set-up

    def _refuse_to_overwrite(self) -> None:
        if not self.resume and ckpt.list_checkpoints(self.run_dir):
            raise ConfigError(
                f"run.output_dir={str(self.run_dir)!r} already holds checkpoints: resume it with "
                f"`gyremedia train --resume {self.run_dir}` or set run.output_dir to a new folder"
            )

    def _check_resumed_settings(self, overridden: list[str] | tuple[str, ...]) -> None:
        """Before any model loads: refuse settings that differ from those the newest checkpoint was trained with
        (see :func:`gyremedia.runs.check_resumed_settings`), except those ``overridden`` lets through."""
        newest = ckpt.latest_checkpoint(self.run_dir, warn=False)
        saved = ckpt.saved_config(newest) if newest is not None else None
        source = newest
        if saved is None and (self.run_dir / RESOLVED_CONFIG).is_file():  # a checkpoint written before 2026-12
            saved, source = (self.run_dir / RESOLVED_CONFIG).read_text(), self.run_dir / RESOLVED_CONFIG
        if saved is None:
            return
        changed = check_resumed_settings(saved, self.config, list(overridden), source)
        if changed:
            logger.warning("resuming with changed settings (--override-resumed): %s", ", ".join(changed))

    def setup(self) -> TrainState:
        """Write the resolved config, build components, prepare with accelerate, maybe resume."""
        from accelerate.utils import set_seed

        acc, state = self.accelerator, self.state
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.write_atomically(self.run_dir / RESOLVED_CONFIG, self.config.to_yaml().encode())
        acc.wait_for_everyone()
        set_seed(self.core.run.seed, device_specific=True)
        state.plugins.hook.gyremedia_configure(config=self.config, accelerator=acc)

        context = BuildContext(device=acc.device, run_dir=self.run_dir, accelerator=acc, seed=self.core.run.seed,
                               is_main_process=acc.is_main_process, mixed_precision=self.core.train.mixed_precision)
        state.backbone = state.plugins.build(self.config.backbone, context)
        # a policy that samples its own transitions has no sampler section
        state.sampler = state.plugins.build(self.config.sampler, context) if self.config.sampler is not None else None
        self.eval_sampler = (state.plugins.build(self.config.eval_sampler, context)
                             if self.config.eval_sampler is not None else state.sampler)
        state.objective = state.plugins.build(self.config.objective, context)
        if self.config.weighting is not None:
            state.weighting = state.plugins.build(self.config.weighting, context)
        state.rewards = {s.name: state.plugins.build(s, context) for s in self.config.rewards}
        self.scorer = Scorer(self.config.rewards, state.rewards)
        adv = self.core.advantage
        self.stat_tracker = PromptStatTracker(adv.history, adv.min_count, adv.std, adv.eps) if adv.history else None
        self.monitor = HackingMonitor(self.core.monitor, {s.name: state.plugins.build(s, context) for s in self.config.gold_rewards},
                                      proxy=f"eval/{self.config.rewards[0].name}", selected=self.config.gold_rewards)
        state.regularizers = {s.name: state.plugins.build(s, context) for s in self.config.regularizers}
        state.loggers = [state.plugins.build(s, context) for s in self.config.loggers] if acc.is_main_process else []
        components = [state.objective, *state.regularizers.values(), self.monitor]
        if any(getattr(c, "needs_reference", False) for c in components):
            state.backbone.enable_reference()

        # A checkpoint's weights go in before sharding; its optimizer state once the optimizer exists.
        loaded = self._read_checkpoint() if self.resume else None
        if loaded is not None:
            state.backbone.load_trainable_state_dict(loaded.weights)
        if self.sharded:
            blocks = state.backbone.shard()
            logger.info("FSDP2: the model is sharded over %d processes by %d blocks", acc.num_processes, blocks)
        if self.core.train.compile:  # after sharding: the blocks' all-gathers run around the compiled graphs
            state.backbone.compile()
            logger.info("train.compile: the first rollout, update and evaluation compile the model (a minute or "
                        "more on a CPU); later ones run compiled")
        module = state.backbone.trainable_module()
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the backbone has no trainable parameters")
        train = self.core.train
        optimizer = adamw(params, train.fused_adamw, lr=train.learning_rate,
                          betas=(train.adam_beta1, train.adam_beta2), weight_decay=train.weight_decay)
        warmup = max(train.warmup_steps, 0)
        # One LR-schedule step per optimizer step. Not passed to accelerate.prepare, which would
        # advance it once per process and make the schedule depend on the process count.
        state.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        if self.sharded:  # sharded in place, the same fully_shard calls accelerate's FSDP2 makes (gyremedia/sharding.py)
            prepared, state.optimizer = module, optimizer
        else:
            prepared, state.optimizer = acc.prepare(module, optimizer)
        state.backbone.set_training_module(prepared)
        self._trained_module = prepared
        self._params = params

        if loaded is not None:
            self._resume(loaded)
        return state

    def _unless_sharded(self, key: str, enabled: bool, why: str) -> bool:
        """Whether ``train.<key>`` is on: a sharded model turns it off, with a warning that says why."""
        if enabled and self.sharded:
            logger.warning("train.%s is off: %s", key, why)
        return enabled and not self.sharded

    def _read_checkpoint(self) -> ckpt.LoadedCheckpoint | None:
        """The newest checkpoint that reads whole (damaged newer ones are skipped, with a warning)."""
        loaded = ckpt.read_latest_checkpoint(self.accelerator, self.run_dir)
        if loaded is None:  # stopped before its first checkpoint (a run whose checkpoints are all damaged raises)
            logger.warning("no checkpoint in %s yet: starting from step 0", self.run_dir)
        elif bool(loaded.state.get("sharded", False)) != self.sharded:
            saved = "sharded" if loaded.state.get("sharded") else "unsharded"
            how = (f"on {loaded.state['num_processes']} processes with train.sharding=fsdp2" if loaded.state.get("sharded")
                   else "with train.sharding=none")
            raise ConfigError(f"{loaded.path} was written by a {saved} run (its optimizer state is laid out for it): "
                              f"resume it {how}")
        return loaded

    def _resume(self, loaded: ckpt.LoadedCheckpoint) -> None:
        """Continue from a checkpoint whose weights are already in the backbone."""
        state, acc = self.state, self.accelerator
        if self.sharded:
            def load_optimizer(saved: dict[str, Any]) -> None:
                sharding.load_full_optimizer_state_dict(self._trained_module, state.optimizer, saved)
        else:
            load_optimizer = state.optimizer.load_state_dict
        ckpt.apply_checkpoint(loaded, load_optimizer=load_optimizer, scheduler=state.lr_scheduler,
                              process_index=acc.process_index)
        self._apply_optimizer_settings()
        for name, component in self._stateful_components().items():
            component.load_state_dict(loaded.state["components"].get(name, {}))
        state.step = loaded.state["step"]
        state.plugins.hook.gyremedia_on_load_checkpoint(state=state, path=loaded.path,
                                                        plugin_state=loaded.state.get("plugins", {}))
        logger.info("resumed from %s at step %d", loaded.path, state.step)

    def _apply_optimizer_settings(self) -> None:
        """The config's AdamW settings and LR schedule over the restored optimizer state (which carries the ones
        it was saved with): unchanged, this rewrites the same values; changed with ``--override-resumed``, the new
        ones apply from the restored step on."""
        train, optimizer, schedule = self.core.train, self.state.optimizer, self.state.lr_scheduler
        schedule.base_lrs = [train.learning_rate] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas):
            group.update(initial_lr=train.learning_rate, lr=train.learning_rate * factor(schedule.last_epoch),
                         betas=(train.adam_beta1, train.adam_beta2), weight_decay=train.weight_decay)
        schedule._last_lr = [group["lr"] for group in optimizer.param_groups]

    # ------------------------------------------------------------------ one step

    def _rank_slice(self) -> tuple[int, int]:
        per_rank = self.core.rollout.batch_size // self.accelerator.num_processes
        start = self.accelerator.process_index * per_rank
        return start, per_rank

    def group_prompts(self, step: int) -> list[str]:
        """The prompt of every group of step ``step`` (the same draw on every rank), drawn once: the rollout,
        the next step's prompt prefetch and the per-prompt advantage history all read it."""
        if step not in self._group_prompts:
            r = self.core.rollout
            self._group_prompts = {s: p for s, p in self._group_prompts.items() if s >= step - 1}
            self._group_prompts[step] = self.prompts.groups_for_step(self.core.run.seed, step, r.batch_size // r.group_size)
        return self._group_prompts[step]

    def rollout_request(self, step: int) -> RolloutRequest:
        """This rank's share of step ``step``: its prompts (the same draw on every rank), ids and chunks."""
        r = self.core.rollout
        group_prompts = self.group_prompts(step)
        start, per_rank = self._rank_slice()
        sample_ids = torch.arange(start, start + per_rank)
        group_ids = sample_ids // r.group_size
        pareto = self.core.pareto
        preference = (preference_weights(self.core.run.seed, step, group_ids, len(self.config.rewards), pareto.concentration)
                      if pareto.enabled else None)
        keep = tuple(self.planned_forwards(step)) if self.reuse_forwards else ()
        return RolloutRequest(step=step, seed=self.core.run.seed, prompts=[group_prompts[g] for g in group_ids.tolist()],
                              sample_ids=sample_ids, group_ids=group_ids, chunks=self.core.train.num_minibatches,
                              settings=r, preference=preference, keep_forwards=keep)

    def planned_forwards(self, step: int) -> list[int]:
        """The transitions whose forwards step ``step``'s rollout keeps (``train.reuse_rollout_forward``): those the
        objective will train, chosen among the ones the sampler will sample stochastically."""
        state = self.state
        stochastic = stochastic_steps(state.sampler, state.backbone.sigmas(self.core.rollout.num_steps))
        return state.objective.planned_transitions(stochastic, step)

    def collect_rollout(self, step: int) -> Rollout:
        """The rollout stage (``gyremedia_collect_rollout``): by default the policy samples the request itself."""
        state = self.state
        state.backbone.trainable_module().eval()
        request = self.rollout_request(step)
        pool_reward = self.choose_candidates(request) if self.core.rollout.candidates else None
        # forwards kept for training do not synchronise gradients: their minibatch averages them itself
        with self.accelerator.no_sync(self._trained_module) if request.keep_forwards else contextlib.nullcontext():
            rollout = state.plugins.hook.gyremedia_collect_rollout(state=state, request=request)
        if request.preference is not None:  # what the advantages weigh the rewards by
            rollout.extras["preference"] = request.preference
        if pool_reward is not None:
            rollout.extras["candidate_reward"] = pool_reward
        return rollout

    def candidate_pool(self, request: RolloutRequest, num_steps: int) -> RolloutRequest:
        """The request of ``rollout.candidates`` candidates per group of ``request``, each from its own initial
        noise (key ``group * candidates + index`` in the candidate stream), sampled ``num_steps`` steps."""
        r = self.core.rollout
        per_group = r.candidates
        groups = request.group_ids[::r.group_size]
        keys = (groups[:, None] * per_group + torch.arange(per_group)).flatten()  # unique per group and candidate
        return RolloutRequest(step=request.step, seed=request.seed,
                              prompts=[p for p in request.prompts[::r.group_size] for _ in range(per_group)],
                              sample_ids=keys, group_ids=groups.repeat_interleave(per_group),
                              chunks=request.chunks * per_group // r.group_size,
                              settings=dataclasses.replace(r, num_steps=num_steps, branch_steps=[]),
                              noise_ids=keys, noise_stream=Stream.CANDIDATES)

    def choose_candidates(self, request: RolloutRequest) -> float:
        """Sol-RL's first stage: draw ``rollout.candidates`` initial noises per group, sample each with
        ``rollout.candidate_steps`` steps of the eval sampler, score them, and point ``request`` at the noises
        of each group's best and worst (:func:`gyremedia.candidates.contrastive_subset`). Returns the pool's
        mean total reward."""
        state, r = self.state, self.core.rollout
        pool = self.candidate_pool(request, r.candidate_steps)
        candidates = state.backbone.collect_rollout(pool, self.eval_sampler)
        scored = error = None
        try:
            scored = self.scorer.collect(self.scorer.submit(state.backbone.media(candidates), pool.prompts),
                                         pool.prompts, request.step)
        except Exception as exc:  # noqa: BLE001 - re-raised on every process
            error = exc
        raise_together(self.accelerator, error)
        candidates.rewards = {name: scores["score"] for name, scores in scored.components.items()}
        matrix, weights = self.weighted_rewards(candidates)
        totals = matrix.double() @ weights.double()
        groups = len(pool.prompts) // r.candidates
        chosen = contrastive_subset(totals.reshape(groups, r.candidates), r.group_size)
        request.noise_ids = pool.noise_ids.reshape(groups, r.candidates).gather(1, chosen).flatten()
        request.noise_stream = Stream.CANDIDATES
        return means_over_ranks(self.accelerator, {"reward": float(totals.nanmean())})["reward"]

    def start_scoring(self, rollout: Rollout) -> dict[str, Any]:
        """Decode the rollout and hand its media to the rewards' worker threads; returns at once."""
        rollout.media = self.state.backbone.media(rollout)
        return self.scorer.submit(rollout.media, rollout.prompts)

    def score(self, rollout: Rollout, step: int, futures: dict[str, Any] | None = None) -> dict[str, float]:
        """Wait for every reward (failure policies applied); set ``rollout.rewards`` and ``rollout.reward``."""
        state, acc = self.state, self.accelerator
        per_sample, dropped, error = {}, torch.zeros(len(rollout), dtype=torch.bool), None
        try:  # this process's rewards; a failure here stops every process (raise_together), not this one alone
            scored = self.scorer.collect(futures if futures is not None else self.start_scoring(rollout),
                                         rollout.prompts, step)
            for name, scores in scored.components.items():
                rollout.rewards[name] = scores.pop("score").to(acc.device)
                dropped |= scored.dropped[name]
                per_sample.update({f"reward/{name}/{k}": v for k, v in scores.items()})
                if self.scorer.may_drop(name):
                    per_sample[f"reward/{name}/dropped"] = scored.dropped[name].float()
            state.plugins.hook.gyremedia_process_rewards(state=state, rollout=rollout, rewards=rollout.rewards)
            for name, values in rollout.rewards.items():
                bad = (~torch.isfinite(values.cpu()) & ~dropped).nonzero().flatten()
                if len(bad):
                    raise reward_error(name, step, rollout.prompts, f"the score after gyremedia_process_rewards is "
                                       f"{values[bad[0]].item()}", int(bad[0]))
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every process
            error = exc
        raise_together(acc, error)
        matrix, weights = self.weighted_rewards(rollout)
        rollout.reward = (matrix * weights.to(matrix.device)).sum(dim=1)
        per_sample.update({f"reward/{name}": v for name, v in rollout.rewards.items()})
        metrics = global_nanmeans(acc, per_sample)
        for key in [k for k in metrics if k.endswith("/dropped")]:
            metrics[key] *= self.core.rollout.batch_size  # a count over the whole batch, not a share
        self._stop_if_dropping_too_many(metrics, step)
        return metrics

    def _stop_if_dropping_too_many(self, metrics: dict[str, float], step: int) -> None:
        """Stop (every process alike: the counts are global) when a reward with ``on_failure: drop`` dropped more
        than its ``max_dropped`` share of the samples over the last :data:`DROP_WINDOW` steps: a reward server that
        is down would otherwise drop every sample while the weights still move (momentum, weight decay)."""
        for i, selected in enumerate(self.config.rewards):
            count = metrics.get(f"reward/{selected.name}/dropped")
            if count is None:
                continue
            window = self._dropped.setdefault(selected.name, collections.deque(maxlen=DROP_WINDOW))
            window.append(count)
            share = sum(window) / (len(window) * self.core.rollout.batch_size)
            if share > selected.settings.max_dropped:
                raise RewardError(
                    f"reward {selected.name!r} dropped {sum(window):.0f} of {len(window) * self.core.rollout.batch_size} "
                    f"samples over the last {len(window)} step(s) up to step {step}, more than "
                    f"rewards.{i}.max_dropped={selected.settings.max_dropped} allows: is it reachable (a server down?); "
                    f"raise max_dropped to train on through such failures")

    def weighted_rewards(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores ``[B, R]`` (one column per reward) and their weights: ``[R]``, or ``[B, R]`` in a
        Pareto run (each group's preference times the rewards' weights)."""
        matrix = torch.stack([rollout.rewards[s.name].float() for s in self.config.rewards], dim=1)
        weights = torch.tensor([s.weight for s in self.config.rewards])
        if "preference" in rollout.extras:
            weights = rollout.extras["preference"].float().cpu() * weights
        return matrix, weights

    def compute_advantages(self, rollout: Rollout, step: int) -> dict[str, float]:
        adv = self.core.advantage
        matrix, weights = self.weighted_rewards(rollout)
        normalize = None
        if self.stat_tracker is not None:  # DDPO's per-prompt history: keyed by the prompt, not the step's group
            prompts = self.group_prompts(step)
            normalize = lambda totals, groups: self.stat_tracker(totals, [prompts[g] for g in groups.tolist()])  # noqa: E731
        rollout.advantages, totals, groups = distributed_group_advantages(
            self.accelerator, matrix, weights, rollout.group_ids, rollout.sample_ids, adv.combine, adv.std, adv.eps,
            normalize=normalize)
        kept = torch.isfinite(totals)
        group_std = [totals[(groups == g) & kept].std(unbiased=False) for g in groups[kept].unique()]
        return {"reward": totals[kept].mean().item(), "reward_std": totals[kept].std(unbiased=False).item(),
                "reward_group_std": torch.stack(group_std).mean().item() if group_std else float("nan")}

    def optimize(self, rollout: Rollout, step: int) -> dict[str, float]:
        """One optimizer step per minibatch; gradients accumulate over the objective's micro-steps."""
        state, acc, train = self.state, self.accelerator, self.core.train
        state.backbone.trainable_module().train()
        ctx = ObjectiveContext(backbone=state.backbone, sampler=state.sampler, guidance_scale=self.core.rollout.guidance_scale,
                               step=step, weighting=state.weighting, accelerator=acc, minibatches=train.num_minibatches,
                               passes=train.num_iterations)
        size = len(rollout) // train.num_minibatches
        sums: dict[str, float] = {}
        count = skipped = 0
        prepare = getattr(state.objective, "prepare", None)
        if callable(prepare):
            prepare(ctx, rollout)
        for n, begin in enumerate([b for _ in range(train.num_iterations) for b in range(0, len(rollout), size)]):
            if n:  # after the first update the forwards kept while sampling are stale
                KeptForwards.discard(rollout)
            batch = rollout.select(slice(begin, begin + size))
            reduce_here = KeptForwards.KEY in batch.extras and acc.num_processes > 1  # their backward syncs nothing
            micro_steps = state.objective.micro_steps(batch, step)
            summed: dict[str, torch.Tensor | float] = {}  # each term's sum over the micro-steps, where it was computed
            for k, micro in enumerate(micro_steps):
                last = k == len(micro_steps) - 1
                # sharded gradients are reduce-scattered every micro-step (skipping it would keep whole ones)
                sync = contextlib.nullcontext() if (last and not reduce_here) or self.sharded else \
                    acc.no_sync(self._trained_module)
                with sync:
                    out = state.objective.loss(ctx, batch, micro)
                    loss, terms = out.loss, dict(out.metrics)
                    for selected in self.config.regularizers:
                        regularizer = state.regularizers[selected.name]
                        result = regularizer(state=state, rollout=batch, outputs=out.outputs)
                        if isinstance(result, LossOutput):  # one loss term plus metrics
                            loss = loss + selected.weight * result.loss
                            terms[f"{selected.name}/loss"] = result.loss.detach()
                            terms.update({f"{selected.name}/{k}": v.detach() for k, v in result.metrics.items()})
                            continue
                        for key, value in result.items():  # named loss terms
                            loss = loss + selected.weight * value
                            terms[f"{selected.name}/{key}"] = value.detach()
                    terms["loss"] = loss.detach()
                    acc.backward(loss / len(micro_steps))
                for key, value in terms.items():  # in float32 on the device (bf16 terms would lose digits)
                    summed[key] = summed.get(key, 0.0) + (value.detach().float() if isinstance(value, torch.Tensor)
                                                          else value)
                count += 1
            if reduce_here:
                average_gradients(acc, self._params)
            summed["grad_norm"] = acc.clip_grad_norm_(self._params, train.max_grad_norm)
            # The one read of the device per optimizer step (a float() per term and micro-step would make the host
            # wait for the accelerator each time). A sum is not finite when one of its micro-steps' values is not
            # (or when finite values overflow float32 together, beyond 3.4e38: a diverged run all the same).
            values = host_floats(summed)
            not_finite = {key for key, value in values.items() if not math.isfinite(value)}
            grad_norm = values.pop("grad_norm")
            for key, value in values.items():
                sums[key] = sums.get(key, 0.0) + value
            # Every rank takes the same decision (a NaN on one rank reaches the others' gradients anyway).
            if means_over_ranks(acc, {"not_finite": float(bool(not_finite))})["not_finite"] > 0:
                if train.on_nonfinite == "stop":
                    raise NonFiniteLoss(step + 1, sorted(not_finite) or ["(on another process)"],
                                        self._last_save[0] if self._last_save else None)
                logger.warning("step %d: %s not finite: update skipped (train.on_nonfinite=skip)", step + 1,
                               ", ".join(sorted(not_finite)) or "a loss term on another process")
                state.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            state.optimizer.step()
            state.lr_scheduler.step()
            state.optimizer.zero_grad(set_to_none=True)
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm * len(micro_steps)
        KeptForwards.discard(rollout)  # a single minibatch, or one that did not replay what was kept
        metrics = means_over_ranks(acc, {key: total / count for key, total in sums.items()})
        metrics["lr"] = state.lr_scheduler.get_last_lr()[0]
        if train.on_nonfinite == "skip":
            self._nonfinite_skipped += skipped
            metrics["train/nonfinite_skipped"] = float(self._nonfinite_skipped)
        return metrics

    def _sample_and_submit(self, step: int) -> tuple[Rollout, dict[str, Any], float]:
        """Sample step ``step``'s rollout and start scoring it; returns it, its reward futures, the seconds taken."""
        start = time.perf_counter()
        rollout = self.collect_rollout(step)
        self.state.plugins.hook.gyremedia_after_rollout(state=self.state, rollout=rollout)
        futures = self.start_scoring(rollout)
        return rollout, futures, time.perf_counter() - start

    def train_step(self, step: int) -> dict[str, float]:
        """Sample (or take the rollout sampled during the last step), score, compute advantages, optimize.

        With ``rollout.async_scoring`` the next step's rollout is sampled while this one's rewards
        run in their worker threads, so a slow reward costs only what sampling does not hide.
        """
        state = self.state
        rollout, futures, sampling = self._pending.pop(step, None) or self._sample_and_submit(step)
        prefetch = getattr(state.backbone, "prefetch", None)  # a backbone may encode the next prompts meanwhile
        if callable(prefetch) and step + 1 < self.core.train.steps:  # the draw is cached for the rollout itself
            prefetch(self.rollout_request(step + 1).prompts)
        times = {"time/rollout": sampling}
        if self.core.rollout.async_scoring and step + 1 < self.core.train.steps:
            self._pending[step + 1] = upcoming = self._sample_and_submit(step + 1)
            times["time/rollout"] = upcoming[2]
        start = time.perf_counter()
        metrics = self.score(rollout, step, futures)
        metrics.update(self.compute_advantages(rollout, step))
        if "forward_fraction" in rollout.extras:  # tree rollouts: model evaluations vs a flat rollout's
            metrics["rollout/forward_fraction"] = rollout.extras["forward_fraction"]
        if "candidate_reward" in rollout.extras:  # two-stage rollouts: the cheap pool's mean reward
            metrics["rollout/candidate_reward"] = rollout.extras["candidate_reward"]
        times["time/reward"] = time.perf_counter() - start
        start = time.perf_counter()
        metrics.update(self.optimize(rollout, step))
        times["time/train"] = time.perf_counter() - start
        state.rollout = rollout
        metrics.update(times)
        return metrics

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int) -> dict[str, float]:
        """Score the fixed-seed eval samples (main process) and save a captioned grid of them.

        A sharded model computes on every process at once: then all of them generate and score, and the
        main one reports."""
        state, main = self.state, self.accelerator.is_main_process
        metrics: dict[str, float] = {}
        error = None
        try:  # the other processes wait at raise_together, which also tells them if this failed
            if main or self.sharded:
                result = evaluation.evaluate(self.config, state.backbone, self.eval_sampler, state.rewards, step=step)
                metrics = result.means()
                self.monitor.on_eval(step, result, metrics, state.backbone, self.core.rollout.guidance_scale)
                if self.core.pareto.enabled and step == self.core.train.steps:
                    metrics.update(self._pareto_front())
            if main:
                name = "before" if step == 0 else "after" if step == self.core.train.steps else f"step-{step:06d}"
                evaluation.save_grid(result.media, result.prompts, self.run_dir / "samples" / f"{name}.png",
                                     self.core.eval.grid_size)
                if step == 0:
                    self._base_metrics = metrics
                if step in (0, self.core.train.steps):
                    self._eval_scores[step] = dict(result.scores)
                state.plugins.hook.gyremedia_on_eval(state=state, media=result.media, metrics=metrics)
        except Exception as exc:  # noqa: BLE001 - re-raised on every process
            error = exc
        raise_together(self.accelerator, error)
        return metrics

    def _pareto_front(self) -> dict[str, float]:
        """Sweep the preference weights of the trained model; the main process writes the front (json, plot)."""
        front = evaluation.pareto_front(self.config, self.state.backbone, self.eval_sampler, self.state.rewards)
        names = [s.name for s in self.config.rewards]
        if self.accelerator.is_main_process:
            (self.run_dir / "pareto_front.json").write_text(json.dumps(front, indent=1))
            base = self._base_metrics
            plot_pareto_front(front, names, self.run_dir / "pareto_front.png",
                              base={n: base[f"eval/{n}"] for n in names} if base else None)
            logger.info("pareto front: %s", "; ".join(f"{p['weights']}: " + ", ".join(f"{n} {p[n]:.3f}" for n in names)
                                                      for p in front))
        return {f"pareto/{i}/{name}": point[name] for i, point in enumerate(front) for name in names}

    # ------------------------------------------------------------------ loop

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.state.loggers:
            sink.log(metrics, step)

    def save(self) -> Path:
        """Checkpoint the current step (every rank); plugins' hooks see the folder being written."""
        state = self.state

        def plugin_state(folder: Path) -> dict[str, Any]:
            return {k: v for k, v in call_each(state.plugins.pm, "gyremedia_on_save_checkpoint", state=state,
                                               path=folder).items() if v is not None}

        # sharded, both are collectives that give the whole state to the main process
        optimizer_state = (sharding.full_optimizer_state_dict(self._trained_module, state.optimizer) if self.sharded
                           else state.optimizer.state_dict())
        path = ckpt.save_checkpoint(
            self.accelerator, self.run_dir, state.step, weights=state.backbone.trainable_state_dict(),
            optimizer_state=optimizer_state, scheduler=state.lr_scheduler, plugin_state=plugin_state,
            keep_last=self.core.checkpoint.keep_last, sharded=self.sharded, config_yaml=self.config.to_yaml(),
            component_state={name: c.state_dict() for name, c in self._stateful_components().items()},
        )
        self._last_save = (state.step, time.monotonic())
        return path

    def _stateful_components(self) -> dict[str, Any]:
        """Selected components with tensors to checkpoint (``state_dict``/``load_state_dict``)."""
        state = self.state
        candidates = {"objective": state.objective, "sampler": state.sampler, "weighting": state.weighting,
                      "monitor": self.monitor, "advantage": self.stat_tracker,
                      **{f"reward/{k}": v for k, v in state.rewards.items()},
                      **{f"regularizer/{k}": v for k, v in state.regularizers.items()}}
        return {name: c for name, c in candidates.items()
                if callable(getattr(c, "state_dict", None)) and callable(getattr(c, "load_state_dict", None))}

    def finish(self) -> None:
        """Main process: plot the metrics and export the trained generator into the run folder."""
        if self.sharded and self.core.export.on_train_end:
            self.state.backbone.unshard()  # every process sends its shards; the main one gets the whole model
        if not self.accelerator.is_main_process:
            return
        metrics_file = self.run_dir / "metrics.jsonl"
        if metrics_file.is_file():
            shown = dict.fromkeys([f"eval/{evaluation.accuracy_key(self.config)}",
                                   *(f"eval/{s.name}" for s in self.config.rewards)])
            plot_metrics(metrics_file, self.run_dir / "reward_curve.png", eval_keys=list(shown))
        changes = self._heldout_changes()
        if changes:
            (self.run_dir / CHANGES_FILE).write_text(json.dumps(changes, indent=1))
        if self.core.export.on_train_end:
            # the run's own export folder: replaced whole (a resumed run that trained longer exports again)
            export_whole(self.state.backbone, self.run_dir / EXPORT_DIR, merge_lora=self.core.export.merge_lora)
            logger.info("exported the trained pipeline to %s", self.run_dir / EXPORT_DIR)

    def _heldout_changes(self) -> dict[str, dict[str, float]]:
        """Every eval score (rewards, their parts, gold rewards), last step minus step 0 over the same samples,
        with a paired 95% interval; empty unless this run evaluated both."""
        base, final = self._eval_scores.get(0), self._eval_scores.get(self.core.train.steps)
        if not base or not final:
            return {}
        return {k: evaluation.paired_difference(base[k], final[k]) for k in sorted(final) if k in base}

    def train(self) -> TrainState:
        """Run from the current step to ``train.steps``; returns the final state.

        A SIGTERM or SIGINT finishes the current step, writes a checkpoint and raises :class:`Interrupted`
        (a second one exits at once); ``checkpoint.max_lost_seconds`` bounds the work a kill can lose.
        """
        state = self.setup() if self.state.backbone is None else self.state
        acc, total, every = self.accelerator, self.core.train.steps, self.core.checkpoint.every
        self._started = time.monotonic()
        self._last_save = self._last_save or (state.step, time.monotonic())
        progress = tqdm(total=total, initial=state.step, desc="train", dynamic_ncols=True,
                        disable=not (acc.is_main_process and self.core.logging.progress))
        try:
            with self._signals_handled():
                if state.step == 0:
                    self._log(self.evaluate(0), 0)
                while state.step < total:
                    step = state.step
                    metrics = self.train_step(step)
                    state.step = step + 1
                    metrics["step"] = state.step
                    if self.core.eval.every and state.step % self.core.eval.every == 0 and state.step < total:
                        metrics.update(self.evaluate(state.step))
                    if state.step == total:
                        metrics.update(self.evaluate(state.step))
                    state.plugins.hook.gyremedia_on_step_end(state=state, metrics=metrics)
                    state.last_metrics = metrics
                    self._log(metrics, state.step)
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['reward']:.4f}", loss=f"{metrics['loss']:.4g}")
                    stop, overdue = self._agree(self._signal is not None, self._save_overdue())
                    if state.step % every == 0 or state.step == total or overdue or stop:
                        self.save()
                    if stop:
                        checkpoint = self.run_dir / ckpt.CHECKPOINT_DIR / ckpt.checkpoint_name(state.step)
                        raise Interrupted(self._signal or signal.SIGTERM, state.step, checkpoint, self.run_dir)
                self._finishing = True  # a signal now lets the export finish (the last checkpoint is written)
                error = None
                try:
                    self.finish()
                except Exception as exc:  # noqa: BLE001 - re-raised on every process
                    error = exc
                raise_together(acc, error)
            state.plugins.hook.gyremedia_on_train_end(state=state)
        except BaseException as exc:
            state.plugins.hook.gyremedia_on_exception(state=state, exc=exc)
            raise
        finally:
            progress.close()
            for sink in state.loggers:
                sink.close()
        return state

    def _save_overdue(self) -> bool:
        """Whether ``checkpoint.max_lost_seconds`` have passed since the last checkpoint."""
        limit = self.core.checkpoint.max_lost_seconds
        return bool(limit) and time.monotonic() - self._last_save[1] >= limit

    def _agree(self, *flags: bool) -> list[bool]:
        """Each flag, true if it is true on any rank (one collective), so every rank takes the same branch."""
        if self.accelerator.num_processes == 1:
            return list(flags)
        local = torch.tensor([float(f) for f in flags], device=self.accelerator.device)
        return [bool(v) for v in (self.accelerator.gather(local[None]).amax(dim=0) > 0).tolist()]

    @contextlib.contextmanager
    def _signals_handled(self):
        """SIGTERM / SIGINT ask the loop to stop after the current step; a second one exits at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            if self._signal is not None:
                sys.stderr.write(f"gyremedia: second {name}: exiting now, without a checkpoint\n")
                os._exit(128 + signum)
            self._signal = signum
            if self._finishing:
                logger.warning("%s received during the end-of-run export: finishing it (every step is trained and "
                               "checkpointed; send it again to exit at once)", name)
                return
            logger.warning("%s received: finishing step %d, then writing a checkpoint and stopping "
                           "(send it again to exit at once)", name, self.state.step + 1)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def summary(self) -> list[str]:
        """What a finished run learned and where its artifacts are (main process), a few lines for the terminal."""
        run, lines = self.run_dir, []
        minutes, seconds = divmod(round(time.monotonic() - getattr(self, "_started", time.monotonic())), 60)
        lines.append(f"trained {self.state.step} steps in {minutes} min {seconds} s; run folder: {run}")
        key = evaluation.accuracy_key(self.config)
        changes = self._heldout_changes()
        base, final = (self._eval_scores.get(step, {}).get(key) for step in (0, self.core.train.steps))
        if final is not None:
            values = final[~torch.isnan(final)]
            fraction = bool(len(values)) and bool(((values >= 0) & (values <= 1)).all())
            show = (lambda v: f"{100 * v:.1f}%") if fraction else (lambda v: f"{v:.4g}")
            if base is not None:
                gain = evaluation.paired_gain(base, final)
                diff = ((lambda v: f"{v:+.1f}") if fraction else (lambda v: f"{v / 100:+.4g}"))
                unit = " points" if fraction else ""
                lines.append(f"held-out {key}: {show(evaluation.nanmean(base))} at step 0 -> "
                             f"{show(evaluation.nanmean(final))} at step {self.state.step}: {diff(gain['points'])}{unit} "
                             f"(paired 95% interval {diff(gain['ci95_low'])} to {diff(gain['ci95_high'])}, "
                             f"{gain['samples']} samples)")
            else:
                lines.append(f"held-out {key}: {show(evaluation.nanmean(final))} at step {self.state.step} "
                             "(the base model was evaluated before the resume: `gyremedia eval` compares both)")
        others = [k for k in changes if k != key and "/" not in k.removeprefix("gold/")]  # each reward's own score
        if others:
            lines.append("other held-out scores, trained - base (paired 95% interval): " + "; ".join(
                f"{k} {changes[k]['mean']:+.3g} ({changes[k]['ci95_low']:+.3g} to {changes[k]['ci95_high']:+.3g})"
                for k in others) + f"; all in {run / CHANGES_FILE}")
        grids = sorted((str(p) for p in (run / "samples").glob("*") if p.stem in ("before", "after")), reverse=True)
        if grids:
            lines.append(f"samples: {', '.join(grids)}")
        if (run / "reward_curve.png").is_file():
            lines.append(f"plot:    {run / 'reward_curve.png'}")
        if (run / EXPORT_DIR).is_dir():
            lines.append(f"export:  {run / EXPORT_DIR} (its README.md shows how to load it)")
        lines.append(f"next:    gyremedia eval {run}    |    gyremedia train --resume {run} train.steps=N (train longer)")
        return lines
