"""Small collective helpers over an accelerate ``Accelerator`` (one process or many)."""

from __future__ import annotations

import torch


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


def global_mean(accelerator, values: torch.Tensor, ignore_nan: bool = False) -> float:
    """Mean of a batch-indexed tensor over every rank's samples (optionally of its non-NaN entries)."""
    gathered = accelerator.gather(values.detach().float().to(accelerator.device))
    return (gathered.nanmean() if ignore_nan else gathered.mean()).item()


def mean_over_ranks(accelerator, value: torch.Tensor | float) -> float:
    """Mean of a per-rank scalar over the ranks."""
    tensor = torch.as_tensor(value, dtype=torch.float32, device=accelerator.device).reshape(1)
    return accelerator.gather(tensor.detach()).mean().item()
