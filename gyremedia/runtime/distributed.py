"""Small collective helpers over an accelerate ``Accelerator`` (one process or many), and copies between host and
device made in one go (each copy or read of an accelerator's tensor makes the host wait for it)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


class FailedElsewhere(RuntimeError):
    """Another process failed where the processes meet; this one stops too, with that process's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def raise_together(accelerator, error: BaseException | None) -> None:
    """At a point every process reaches: raise this process's ``error``, or :class:`FailedElsewhere` when another
    process brought one, so no process waits forever for a collective that a failed one never joins. Costs one
    collective when every process is well, and a second (the first failure's message) when one is not."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    failed = accelerator.gather(torch.tensor([float(error is not None)], device=accelerator.device))
    if not bool(failed.any()):
        return
    from accelerate.utils import gather_object

    told = None if error is None else (f"{type(error).__name__}: {error}", getattr(error, "exit_code", 1))
    reports = gather_object([told])
    if error is not None:
        raise error
    rank, (message, code) = next((r, t) for r, t in enumerate(reports) if t is not None)
    raise FailedElsewhere(f"process {rank} failed, so every process stops: {message}", code)


def largest_on_any_rank(accelerator, *values: float) -> list[float]:
    """Each value's largest over the ranks (one collective), so every rank takes the same branch."""
    if accelerator.num_processes == 1:
        return list(values)
    local = torch.tensor([float(v) for v in values], device=accelerator.device)
    return accelerator.gather(local[None]).amax(dim=0).tolist()


def any_rank(accelerator, *flags: bool) -> list[bool]:
    """Each flag, true if it is true on any rank (one collective)."""
    return [value > 0 for value in largest_on_any_rank(accelerator, *map(float, flags))]


def gather_by_sample(accelerator, sample_ids: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gather batch-indexed tensors from all ranks, ordered by global sample id.

    Returns the gathered tensors followed by the sorted sample ids, so every rank sees the whole
    batch in the same order whatever the number of processes.
    """
    device = accelerator.device
    ids = accelerator.gather(sample_ids.to(device))
    order = ids.argsort()
    gathered = [accelerator.gather(t.to(device))[order] for t in tensors]
    return (*gathered, ids[order])


def means_over_ranks(accelerator, values: dict[str, float]) -> dict[str, float]:
    """Each per-rank scalar's mean over the ranks (in float32), in one collective. Every rank must pass the same
    keys (in any order)."""
    keys = sorted(values)
    if accelerator.num_processes == 1 or not keys:
        means = torch.tensor([values[k] for k in keys], dtype=torch.float32).tolist()
    else:
        local = torch.tensor([values[k] for k in keys], dtype=torch.float32, device=accelerator.device)
        means = accelerator.gather(local).reshape(-1, len(keys)).mean(dim=0).tolist()
    by_key = dict(zip(keys, means))
    return {key: by_key[key] for key in values}


def host_floats(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Scalars as Python floats, each device's tensors read in one copy: every ``float()`` of an accelerator's
    tensor makes the host wait until the accelerator has computed everything queued before it. A sharded
    (DTensor) value is gathered first, a collective: then every rank must make the same call."""
    floats: dict[str, float] = {}
    tensors: defaultdict[Any, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            if hasattr(value, "full_tensor"):  # a sharded model's DTensor (the gradient norm under FSDP2)
                value = value.full_tensor()
            tensors[value.device][key] = value.float().reshape(())
        else:
            floats[key] = float(value)
    for on_device in tensors.values():
        floats.update(zip(on_device, torch.stack(list(on_device.values())).tolist()))
    return {key: floats[key] for key in values}


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """CPU copies of ``tensors`` (``None`` stays ``None``; CPU tensors pass through), each device's read in one copy.
    The values travel as float64: exact for every float dtype, booleans, and integers below 2**53."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for position, tensor in enumerate(tensors):
        if tensor is not None and tensor.device.type != "cpu":
            by_device[tensor.device].append(position)
    return _moved_together(
        list(tensors), by_device.values(), lambda part: part.detach().double(), lambda flat: flat.cpu()
    )


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (all on one device, the host's) on ``device``, in one copy per dtype rather than one per tensor
    (views of that copy)."""
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for position, tensor in enumerate(tensors):
        if tensor.device != torch.device(device):
            by_dtype[tensor.dtype].append(position)
    return _moved_together(list(tensors), by_dtype.values(), lambda part: part, lambda flat: flat.to(device))


def _moved_together(
    tensors: list,
    batches: Iterable[list[int]],
    prepare: Callable[[torch.Tensor], torch.Tensor],
    move: Callable[[torch.Tensor], torch.Tensor],
) -> list:
    """``tensors`` with each batch of positions moved in one copy: ``prepare``d, flattened into one tensor, ``move``d,
    then split back into views of their shapes and dtypes."""
    for positions in batches:
        parts = [tensors[p] for p in positions]
        flat = move(torch.cat([prepare(part).reshape(-1) for part in parts]))
        for position, part, values in zip(positions, parts, flat.split([part.numel() for part in parts])):
            tensors[position] = values.view(part.shape).to(part.dtype)
    return tensors


def global_nanmeans(accelerator, values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Mean of each batch-indexed tensor's non-NaN entries over every rank, in one collective.

    Ranks may hold different keys (a reward whose call failed on one rank returns no components
    there), so the local sums and counts travel as objects rather than key by key.
    """
    local = {}
    for key, value in values.items():
        value = value.detach().float().cpu()
        kept = ~torch.isnan(value)
        local[key] = (float(value[kept].sum()), int(kept.sum()))
    parts = [local]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        parts = gather_object([local])
    totals: dict[str, list[float]] = {}
    for part in parts:
        for key, (total, count) in part.items():
            entry = totals.setdefault(key, [0.0, 0])
            entry[0] += total
            entry[1] += count
    return {key: total / count if count else math.nan for key, (total, count) in sorted(totals.items())}


def average_gradients(accelerator, params: Sequence[torch.Tensor]) -> None:
    """Average the parameters' gradients over the ranks in place, as DDP's synchronised backward does (for
    gradients accumulated outside it); each in place, so no second copy of them is held. Every trained parameter
    has a gradient on every rank (DDP requires it), so the ranks run the same collectives."""
    if accelerator.num_processes == 1:
        return
    for p in params:
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)
            p.grad /= accelerator.num_processes
