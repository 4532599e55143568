"""A CPU stand-in for ``torch.cuda.CUDAGraph`` over the CUDA backend's emulated code.

A CUDA graph replays the kernels a capture recorded, with the arguments and the
memory they had then: no Python runs at replay. So a step can be captured only if
everything that changes from step to step lives in device memory (ids, offsets,
clocks, counts, learning rate), and host-side state the step updates in Python goes
stale. ``EmulatedGraph`` does the same on CPU tensors: ``capture()`` records every
aten op (with its arguments and the tensors it returned) and every emulated kernel
launch (``cuda_emulation.py``), in order; ``replay()`` runs them again on the same
tensors, writing each op's results into the tensors the capture returned (the
fixed addresses of a graph's memory pool). A step that still needs Python per step
replays to the wrong result, which is what the tests look for.

A graph holds its own memory pool (what the capture allocated) but only the
addresses of memory allocated before it: the stand-in keeps the tensors the capture
allocated and only weak references to the others (a view is rebuilt from its base at
replay), so a replay after their owner let them go (a table that grew and replaced
its arrays) raises ``RuntimeError`` where a GPU would read freed memory.

One difference from a GPU: capturing here runs the step once (a CUDA capture runs
nothing), so a test counts the capture as a step. While capturing,
``torch.cuda.is_current_stream_capturing()`` is True (and ``torch.cuda.is_available()``),
so the module takes the paths it takes inside a real capture.
"""

import contextlib
import weakref
from typing import Any, List, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["EmulatedGraph"]

# Ops whose output is uninitialized memory: nothing to write back at replay.
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "EmulatedGraph") -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.graph.recording:
            self.graph.records.append(("op", func, args, kwargs, out))
        return out


class EmulatedGraph:
    """Records one step's ops and launches, and replays them.

    Args:
        kernels: the ``EmulatedCudaKernels`` of an ``emulated_cuda`` block.
    """

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.records: List[Tuple] = []
        self.recording = False

    @contextlib.contextmanager
    def capture(self):
        """Within: the step to record (it runs once, as a warm-up would)."""
        kernels = self.kernels
        launch = kernels._launch

        def recorded_launch(name, device, threads, args, shared_mem=0, block=256):
            if threads > 0:  # the pointers' tensors, as they are now
                tensors = kernels.tensors_of(args)
                self.records.append(("launch", name, device, threads, args, shared_mem, block,
                                     tensors))
            self.recording = False  # the emulated kernel's own ops are not the graph's
            try:
                launch(name, device, threads, args, shared_mem, block)
            finally:
                self.recording = True

        kernels._launch = recorded_launch
        saved = torch.cuda.is_available, torch.cuda.is_current_stream_capturing
        torch.cuda.is_available = torch.cuda.is_current_stream_capturing = lambda: True
        self.recording = True
        try:
            with _Recorder(self):
                yield self
        finally:
            self.recording = False
            kernels._launch = launch
            torch.cuda.is_available, torch.cuda.is_current_stream_capturing = saved
            self._keep_only_the_pool()

    def _keep_only_the_pool(self) -> None:
        """Replaces every tensor of the records that the capture did not allocate by
        a weak reference (``_Address``)."""
        pool: Set[int] = set()
        for record in self.records:
            if record[0] == "op":
                for t in tree_flatten(record[4])[0]:
                    if isinstance(t, torch.Tensor):
                        pool.add(t.untyped_storage().data_ptr())

        def weaken(x):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in pool:
                return _Address(x)
            return x

        self.records = [tuple(tree_map(weaken, part) if i > 0 else part
                              for i, part in enumerate(record)) for record in self.records]

    @torch.no_grad()  # a graph knows no autograd: its tensors are memory
    def replay(self) -> None:
        """Runs the recorded ops and launches again, in order."""
        for record in self.records:
            record = tree_map(lambda x: x.tensor() if isinstance(x, _Address) else x, record)
            if record[0] == "launch":
                _, name, device, threads, args, shared_mem, block, tensors = record
                for tensor in tensors.values():  # the pointers' tensors, taken again
                    self.kernels.remember(tensor)
                self.kernels._launch(name, device, threads, args, shared_mem, block)
                continue
            _, func, args, kwargs, out = record
            result = func(*args, **kwargs)
            if func.overloadpacket.__name__ in _UNINITIALIZED:
                continue
            _write_back(out, result)


class _Address:
    """A tensor allocated before the capture, as a graph holds it: its address only
    (a weak reference to its base and the view's geometry)."""

    def __init__(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        self.base = weakref.ref(base)
        self.geometry = (t.size(), t.stride(), t.storage_offset())
        self.what = f"{tuple(t.shape)} {t.dtype}"

    def tensor(self) -> torch.Tensor:
        base = self.base()
        if base is None:
            raise RuntimeError(
                f"graph replay into freed memory: a {self.what} tensor the capture used "
                "was freed since (a GPU would read or write memory the allocator gave away)")
        return base.as_strided(*self.geometry)


def _write_back(recorded: Any, result: Any) -> None:
    """Copies a replayed op's results into the tensors the capture got from it."""
    recorded_flat, _ = tree_flatten(recorded)
    result_flat, _ = tree_flatten(result)
    for old, new in zip(recorded_flat, result_flat):
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            if not _same_memory(old, new):
                old.copy_(new)
