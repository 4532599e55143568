"""Finds the host synchronizations and counts the kernels of a block of torch code.

``SyncGuard`` records every aten op run inside it (with its tensor arguments'
shapes) and every call that would make a GPU wait for the device: the aten ops that
read device data into host memory or size their output by data (``nonzero``,
``unique``, boolean-mask indexing, ``bincount``, ...), an indexed assignment of a
Python number (its value is copied from host memory), and the ``Tensor`` methods that
hand a value to Python (``item``, ``tolist``, ``cpu``, ``bool``/``int``/``float``).
Run over CPU tensors (where none of them costs anything) it shows what the same
code does on a GPU; ``cuda_emulation.emulated_cuda`` routes the CUDA backend's
code onto CPU tensors for it. ``counted_cpu`` counts the CPU backend's own step the
same way: each call of the extension is a launch, and what it does inside (its C++
reading its own inputs) is not recorded.
"""

import contextlib
import os
import traceback
from collections import Counter
from types import ModuleType
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dynamicemb
import dynamicemb.ops as ops
from dynamicemb.ops import cpu_kernels
from dynamicemb.ops.cpu import CpuBackend

__all__ = ["CountedCpuKernels", "LAUNCH_FREE_OPS", "Sync", "SyncGuard", "counted_cpu"]

# Ops that wait for the device: their output's size (or value) depends on data.
_SYNC_OPS = {
    "_local_scalar_dense", "item", "nonzero", "unique", "unique_dim", "_unique",
    "_unique2", "unique_consecutive", "masked_select", "bincount", "equal", "is_nonzero",
    "repeat_interleave",  # without output_size (checked below)
}
# Ops that launch no kernel on a GPU: views, metadata and uninitialized allocation.
LAUNCH_FREE_OPS = {
    "empty", "empty_like", "empty_strided", "view", "_unsafe_view", "slice", "select",
    "as_strided", "squeeze", "unsqueeze", "expand", "t", "transpose", "permute", "detach",
    "alias", "lift_fresh", "_reshape_alias", "split", "unbind", "narrow", "view_as",
    "set_", "resize_", "_to_copy_noop",
}
_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class Sync(NamedTuple):
    """One synchronizing call: what it was and where in dynamicemb it was made."""

    what: str
    where: str


_PACKAGE = os.path.dirname(os.path.abspath(dynamicemb.__file__))


def _site() -> str:
    """The innermost frame of the dynamicemb package that led here."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if os.path.abspath(frame.filename).startswith(_PACKAGE + os.sep):
            path = os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))
            return f"{path}:{frame.lineno} {frame.name}"
    return "outside dynamicemb"


def _is_bool_index(arg) -> bool:
    if isinstance(arg, (list, tuple)):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in arg)
    return False


def _is_host_scalar(args) -> bool:
    """``t[index] = 2.0``: a Python number becomes a 0-dim CPU tensor that a CUDA
    ``index_put_`` copies to the device (a sync). ``index_fill_`` takes it as a
    kernel argument instead."""
    return len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].dim() == 0


class _Recorder(TorchDispatchMode):
    def __init__(self, guard: "SyncGuard") -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        if guard.active:
            name = func.overloadpacket.__name__
            guard.ops.append((name, _shapes(args, kwargs)))
            syncs = name in _SYNC_OPS and not (
                name == "repeat_interleave" and kwargs.get("output_size") is not None)
            if name in ("index", "index_put", "index_put_") and _is_bool_index(
                    args[1] if len(args) > 1 else None):
                syncs = True
            if name in ("index_put", "index_put_") and _is_host_scalar(args):
                syncs = True  # on a GPU: a pageable host-to-device copy of the value
            if syncs:
                guard.syncs.append(Sync(f"aten.{name}", _site()))
        return func(*args, **kwargs)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _shapes(args, kwargs) -> tuple:
    return tuple(tuple(a.shape) for a in _flat(args, kwargs) if isinstance(a, torch.Tensor))


class SyncGuard:
    """Records aten ops and synchronizing calls made while it is active.

    Attributes:
        ops: (op name, tensor argument shapes) of every aten op, in order.
        syncs: every synchronizing call, with its site in dynamicemb.

    Example::

        with SyncGuard() as guard:
            step()
        assert not guard.syncs, guard.report()
    """

    def __init__(self) -> None:
        self.ops: List[Tuple[str, tuple]] = []
        self.syncs: List[Sync] = []
        self.active = False
        self._saved = {}
        self._mode = _Recorder(self)

    def __enter__(self) -> "SyncGuard":
        for name in _METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name, original):
        guard = self

        def method(tensor, *args, **kwargs):
            if guard.active:
                guard.syncs.append(Sync(f"Tensor.{name}", _site()))
                with guard.paused():
                    return original(tensor, *args, **kwargs)
            return original(tensor, *args, **kwargs)

        return method

    @contextlib.contextmanager
    def paused(self):
        """Nothing inside is recorded (an emulated kernel's own work)."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def launches(self) -> int:
        """Aten ops that would launch a GPU kernel (every op but views and allocation)."""
        return sum(1 for name, _ in self.ops if name not in LAUNCH_FREE_OPS)

    def report(self) -> str:
        """The synchronizing calls by site, most frequent first."""
        counts = Counter(self.syncs)
        return "\n".join(f"{n} x {s.what} at {s.where}" for s, n in counts.most_common())


class CountedCpuKernels:
    """The CPU extension with every call of a function counted as a launch; a
    ``guard`` set here is paused while the call runs (the kernel's own work, as an
    emulated CUDA kernel's).

    Args:
        kernels: the extension module; default the process's (``cpu_kernels.load``).

    Attributes:
        launches: function name -> calls so far.
        calls: (function name, tensor argument shapes) of every call, in order.
        guard: a ``SyncGuard`` (or None).
    """

    def __init__(self, kernels: Optional[ModuleType] = None) -> None:
        self._kernels = kernels if kernels is not None else cpu_kernels.load()
        self.launches: Counter = Counter()
        self.calls: List[Tuple[str, tuple]] = []
        self.guard: Optional[SyncGuard] = None

    def __getattr__(self, name: str):
        function = getattr(self._kernels, name)
        if not callable(function):
            return function

        def launch(*args, **kwargs):
            self.launches[name] += 1
            self.calls.append((name, _shapes(args, kwargs)))
            paused = self.guard.paused() if self.guard is not None else contextlib.nullcontext()
            with paused:
                return function(*args, **kwargs)

        return launch


@contextlib.contextmanager
def counted_cpu(kernels: Optional[CountedCpuKernels] = None):
    """Within: the CPU backend's calls of its extension are counted (modules built
    inside keep the counted backend).

    Args:
        kernels: the counter to use again; default a new one.

    Yields:
        The ``CountedCpuKernels``: set its ``guard`` to the ``SyncGuard`` of a step.
    """
    kernels = CountedCpuKernels() if kernels is None else kernels
    backend = CpuBackend(kernels)
    saved = ops._cpu
    ops._cpu = lambda: backend
    try:
        yield kernels
    finally:
        ops._cpu = saved
