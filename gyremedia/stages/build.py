"""Before the first step: the process layout and sharding checked, the components built, the optimizer made."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from gyremedia.config import ConfigError, ResolvedConfig
from gyremedia.interfaces import BuildContext
from gyremedia.scoring import Scorer
from gyremedia.state import TrainState

logger = logging.getLogger("gyremedia")

#: Device types with PyTorch's fused AdamW kernel (torch checks only at the first step, so it is decided here).
FUSED_ADAMW_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


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
    if rollout.branch_steps and (per_rank // train.num_minibatches) % rollout.group_size:
        raise ConfigError(
            f"tree rollouts keep each group whole in one minibatch on one process: make rollout.batch_size / "
            f"(processes x train.num_minibatches) = {per_rank // train.num_minibatches} a multiple of "
            f"rollout.group_size={rollout.group_size}"
        )


def resolve_sharding(config: ResolvedConfig, accelerator: Any) -> bool:
    """Whether this run shards its model (``train.sharding``; ``auto`` follows an accelerate FSDP launch), checked
    before any model loads. Refuses processes that were launched together but each run alone."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > accelerator.num_processes:
        raise ConfigError(
            f"{launched} processes were launched but each runs alone (accelerate sees {accelerator.num_processes}): "
            "every one would train its own copy of the model; launch with `accelerate launch --multi_gpu "
            "--num_processes N` or a config from configs/accelerate/"
        )
    launch = getattr(accelerator.distributed_type, "value", "")
    if launch == "DEEPSPEED":
        # DeepSpeed steps its optimizer inside backward, which breaks the accumulation over an objective's micro-steps
        raise ConfigError(
            "DeepSpeed launches are not supported: shard with FSDP2 instead "
            "(accelerate launch --config_file configs/accelerate/fsdp2.yaml, or train.sharding=fsdp2)"
        )
    choice = config.core.train.sharding
    # without an accelerator device accelerate turns an FSDP launch into plain gloo processes; its flag stays
    fsdp_launch = launch == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if choice == "none" and launch == "FSDP":
        # accelerate.prepare would shard the model itself, behind the trainer's back
        raise ConfigError(
            "train.sharding=none on an FSDP launch: launch with configs/accelerate/ddp.yaml to train "
            "unsharded, or leave train.sharding at auto"
        )
    if choice == "none" or (choice == "auto" and not fsdp_launch):
        return False
    backbone = config.backbone.name
    if not config.backbone.meta.get("shardable"):  # the selection's: its options may say (capabilities())
        raise ConfigError(
            f"train.sharding={choice}: backbone {backbone!r} cannot be sharded (its processes do not "
            "run the same model calls in a step): use train.sharding=none and a DDP launch "
            "(configs/accelerate/ddp.yaml)"
        )
    if accelerator.num_processes == 1:
        logger.info("train.sharding=%s with one process: nothing to shard", choice)
        return False
    return True


def build_components(state: TrainState, context: BuildContext) -> None:
    """Build every selected component, then let the features set up theirs (``gyremedia_setup``)."""
    config, plugins = state.config, state.plugins
    state.backbone = plugins.build(config.backbone, context)
    # a policy that samples its own transitions has no sampler section
    state.sampler = plugins.build(config.sampler, context) if config.sampler is not None else None
    state.eval_sampler = (
        plugins.build(config.eval_sampler, context) if config.eval_sampler is not None else state.sampler
    )
    state.objective = plugins.build(config.objective, context)
    if config.weighting is not None:
        state.weighting = plugins.build(config.weighting, context)
    state.rewards = {s.name: plugins.build(s, context) for s in config.rewards}
    state.scorer = Scorer(config.rewards, state.rewards)
    plugins.hook.gyremedia_setup(state=state, context=context)
    state.regularizers = {s.name: plugins.build(s, context) for s in config.regularizers}
    state.loggers = [plugins.build(s, context) for s in config.loggers] if state.accelerator.is_main_process else []
    if state.reference_needed or any(s.meta.get("needs_reference") for s in [config.objective, *config.regularizers]):
        state.backbone.enable_reference()


def adamw(params: list[torch.nn.Parameter], fused: bool, **options: Any) -> torch.optim.AdamW:
    """AdamW; with ``fused``, its fused kernel where every parameter's device has it (``train.fused_adamw``),
    else the default implementation."""
    fused = fused and all(p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **options)


def build_optimizer(state: TrainState) -> None:
    """AdamW over the trainable parameters, its LR schedule, and the module accelerate prepares (or sharded)."""
    module = state.backbone.trainable_module()
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the backbone has no trainable parameters")
    train = state.config.core.train
    optimizer = adamw(
        params,
        train.fused_adamw,
        lr=train.learning_rate,
        betas=(train.adam_beta1, train.adam_beta2),
        weight_decay=train.weight_decay,
    )
    warmup = max(train.warmup_steps, 0)
    # One LR-schedule step per optimizer step. Not passed to accelerate.prepare, which would
    # advance it once per process and make the schedule depend on the process count.
    state.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
    )
    if (
        state.sharded
    ):  # sharded in place, the same fully_shard calls accelerate's FSDP2 makes (gyremedia/runtime/sharding.py)
        prepared, state.optimizer = module, optimizer
    else:
        prepared, state.optimizer = state.accelerator.prepare(module, optimizer)
    state.backbone.set_training_module(prepared)
    state.trained_module, state.params = prepared, params
