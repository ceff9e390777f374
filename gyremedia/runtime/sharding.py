"""Fully sharded data parallel training (FSDP2) through torch's own ``fully_shard``.

Each process keeps a shard of every parameter, gradient and optimizer state; a block's full weights exist
only while it computes. This is the code path accelerate's FSDP2 plugin takes (``fully_shard`` on every
block class the model lists in ``_no_split_modules``, then on the root), called directly because
accelerate refuses FSDP without an accelerator device, so the same code runs on gloo CPU processes.

Full (unsharded) state dicts are collectives: every rank calls them; with ``cpu_offload`` only rank 0
receives the tensors, which is what checkpoints and exports need (the main process writes them).
"""

from __future__ import annotations

from typing import Any, cast

import torch


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules sharded one by one: instances of the classes in the model's ``_no_split_modules``
    (its transformer blocks, the unit diffusers and transformers keep whole when splitting a model)."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if m is not module and type(m).__name__ in names]


def shard(module: torch.nn.Module, reshard_after_forward: bool = True) -> int:
    """Shard ``module`` in place over the default process group; returns the number of blocks sharded.

    Raises ``ValueError`` for a model that names no blocks (sharding only its root would gather the
    whole model for every forward: no memory saved)."""
    from torch.distributed.fsdp import fully_shard

    units = shard_units(module)
    if not units:
        raise ValueError(f"{type(module).__name__} lists no block classes in _no_split_modules: nothing to shard by")
    for unit in [*units, module]:
        # FSDP2 keeps one dtype per unit of trained weights: a model that keeps some in fp32 beside bf16 ones
        # (diffusers' _keep_in_fp32_modules, e.g. Wan's norms) cannot be trained in bf16 weights sharded
        dtypes = {p.dtype for p in unit.parameters() if p.requires_grad}
        if len(dtypes) > 1:
            raise ValueError(
                f"{type(unit).__name__} trains weights of several dtypes ({', '.join(sorted(map(str, dtypes)))}"
                "), which FSDP2 cannot shard together: keep the weights in fp32 (backbone.dtype=float32"
                ", with train.mixed_precision=bf16 to compute in bf16) or train LoRA adapters"
            )
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward)
    fully_shard(module, reshard_after_forward=reshard_after_forward)
    return len(units)


def _full_options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a sharded ``module``, gathered to rank 0 on the CPU (collective;
    the other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return cast(dict[str, torch.Tensor], get_model_state_dict(module, options=_full_options(cpu_offload=True)))


def full_optimizer_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of a sharded ``module`` keyed by parameter name, gathered to rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_full_options(cpu_offload=True))


def load_full_optimizer_state_dict(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Give every rank its shard of a full optimizer state (each rank passes the whole ``state``)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=_full_options())


def stock_class(module: torch.nn.Module) -> type:
    """The model's own class under the wrapper class ``fully_shard`` gives it (``FSDP<name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(
        c
        for c in type(module).__mro__
        if issubclass(c, torch.nn.Module) and not issubclass(c, FSDPModule) and c is not type(module)
    )


def unsharded_copy(module: torch.nn.Module, prepare=None) -> torch.nn.Module | None:
    """On rank 0, a plain copy of a sharded ``module`` on the CPU (its stock class built from its config, then
    ``prepare(copy)`` (e.g. adding the same adapters), then the gathered weights); ``None`` on other ranks.
    A collective: every rank calls it."""
    state = full_state_dict(module)
    if not state:
        return None
    cls = stock_class(module)
    # diffusers models are built from their config by from_config, transformers models by _from_config
    build = getattr(cls, "_from_config", None) or getattr(cls, "from_config")
    copy = build(module.config)
    dtypes = {name: p.dtype for name, p in module.named_parameters()}
    if prepare is not None:
        prepare(copy)
    for name, param in copy.named_parameters():
        param.data = param.data.to(dtypes.get(name, param.dtype))
    copy.load_state_dict(state)
    return copy.requires_grad_(False).eval()
