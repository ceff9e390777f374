"""A second device on a CPU-only machine, to catch tensors created on the wrong device.

``FakeDevice()`` is a context manager. Inside it, ``.to("meta")``, ``Module.to("meta")`` and factory
calls with ``device="meta"`` give :class:`OnDevice` tensors: CPU tensors that report ``device(type="meta")``,
compute on the CPU (so ``.item()``, ``unique`` and autograd work) and refuse, as CUDA does, any op that
mixes them with a CPU tensor of one or more dimensions (CPU scalars and CPU index tensors are allowed,
as on CUDA). So code that writes ``torch.zeros(n)`` where it should write ``torch.zeros(n, device=x.device)``
fails here the way it would fail on a GPU.

``FakeDevice.syncs`` counts, by op, what would make the host wait for a CUDA device: reading a value
(``.item()``, ``float()``, ``bool()``, ``.tolist()``), a copy between it and the CPU, and ops whose output size
depends on the data (``nonzero``, ``unique``, boolean-mask indexing...).

What it cannot see: kernels that exist only on the real device, dtype support, numerics, speed, and
operations outside PyTorch (numpy on a device tensor fails here only if the code calls ``.numpy()``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")


class DeviceMismatch(RuntimeError):
    """A tensor on the (fake) accelerator met a CPU tensor."""


#: Ops a CUDA tensor accepts CPU tensors in (index tensors are moved by the kernel).
_CPU_ARGS_ALLOWED = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put_.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten._index_put_impl_.default,
}


#: Ops that make the host wait for a CUDA device: a value read back, or an output whose size depends on the data.
_SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten._unique.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.bincount.default,
}
#: The counter of the innermost active :class:`FakeDevice`.
_syncs: list[Counter] = []


def _record_sync(op: str) -> None:
    """Count one wait for the device, by ``op``, in the innermost active :class:`FakeDevice`."""
    if _syncs:
        _syncs[-1][op] += 1


def _count_sync(func, args: tuple, kwargs: dict) -> None:
    """Count ``func(*args, **kwargs)`` if it would make the host wait for a CUDA device."""
    device = kwargs.get("device")
    if func is torch.ops.aten._to_copy.default:  # .to() / .cpu(): a copy when it names the other side's device
        syncs = device is not None and isinstance(args[0], OnDevice) != _is_fake(device)
    elif func is torch.ops.aten.copy_.default:  # dst.copy_(src) across the two
        syncs = isinstance(args[0], OnDevice) != isinstance(args[1], OnDevice)
    elif func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
        # x[mask] and x[mask] = v find the mask's True entries first
        syncs = isinstance(args[0], OnDevice) and any(i is not None and i.dtype == torch.bool for i in args[1])
    elif func is torch.ops.aten.repeat_interleave.Tensor:  # the output's size, unless given
        syncs = isinstance(args[0], OnDevice) and kwargs.get("output_size") is None
    else:
        syncs = func in _SYNCING and any(isinstance(a, OnDevice) for a in args)
    if syncs:
        _record_sync(str(func))


def _is_fake(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == DEVICE.type


class OnDevice(torch.Tensor):
    """A CPU tensor standing in for one on the accelerator (its ops run in :class:`FakeDevice`)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=DEVICE,
            requires_grad=elem.requires_grad,
        )
        wrapper.elem = elem
        return wrapper

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _run(func, args: tuple, kwargs: dict) -> Any:
    """Run an aten op on the CPU data: refuse accelerator/CPU mixes, place factories and copies."""
    flat, _ = tree_flatten((args, kwargs))
    on_device = [t for t in flat if isinstance(t, OnDevice)]
    elsewhere = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and t.dim() > 0]
    if on_device and elsewhere and func not in _CPU_ARGS_ALLOWED:
        raise DeviceMismatch(
            f"{func}: tensors on {DEVICE} (the accelerator) and on "
            f"{sorted({t.device.type for t in elsewhere})}, shapes {[tuple(t.shape) for t in elsewhere]}"
        )
    device = kwargs.get("device")
    _count_sync(func, args, kwargs)
    if device is not None:
        kwargs = {**kwargs, "device": torch.device("cpu")}

    def unwrap(t: Any) -> Any:
        return t.elem if isinstance(t, OnDevice) else t

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    to_device = _is_fake(device) or (device is None and bool(on_device))
    if not to_device:
        return out
    return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t, out)


class _PlaceDataOnDevice(TorchFunctionMode):
    """``torch.tensor(data, device=...)`` and its kin build their tensor below the dispatcher's Python hooks;
    ``tolist`` refuses tensor subclasses."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and _is_fake(kwargs.get("device")):
            _record_sync(f"torch.{func.__name__}")  # built on the CPU, then copied over
            return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        if func is torch.Tensor.tolist and isinstance(args[0], OnDevice):  # CUDA tensors copy to a list too
            _record_sync("tolist")
            return args[0].elem.tolist()
        return func(*args, **kwargs)


class _PlaceOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class FakeDevice:
    """Within the block, ``meta`` behaves as an accelerator device backed by CPU memory (see the module docstring)."""

    def __init__(self) -> None:
        self.syncs: Counter = Counter()

    def __enter__(self) -> FakeDevice:
        _syncs.append(self.syncs)
        self._modes = [_PlaceOps(), _PlaceDataOnDevice()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        assert _syncs.pop() is self.syncs, "FakeDevice blocks must nest"
