"""Where a GPU script of ``make gpu-check`` runs: a CUDA GPU, or the CPU with the
CUDA path emulated (``--emulated``), so that every script's code path runs in CI
before the rare minutes a GPU is at hand.

``Accelerator`` wraps what a script needs from the device: synchronizing, a side
stream, capturing a step in a CUDA graph, the host syncs of a step (PyTorch's sync
debug mode and a profiler count of the CUDA calls that wait), the memory a process
holds, and the kernel launches. ``EmulatedAccelerator`` does the same on CPU
tensors: the CUDA backend's code with its kernels run by the CPU extension
(``test/dynamicemb_testing/cuda_emulation.py``), the graph stand-in
(``graph_emulation.py``) for the capture, and the test suite's ``SyncGuard`` for the
syncs (the profiler there sees no CUDA calls, so its count is zero by construction).

Example::

    with accelerator(emulated=args.emulated) as acc:
        module = make_module(acc.device)
        acc.synchronize()
"""

import contextlib
import gc
import os
import sys
import traceback
import warnings
from collections import Counter
from typing import Any, Callable, Dict, Iterable, Iterator, Tuple

import torch

import dynamicemb
from dynamicemb.ops import for_device

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE = os.path.dirname(os.path.abspath(dynamicemb.__file__))

#: CUDA runtime and driver calls that make the host wait for the device (CuPy's
#: syncs and ``Event.synchronize()`` included, which the sync debug mode misses).
WAITING_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize",
    "cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemcpy",
})
#: The profiler's name of a device-to-host copy (``Memcpy DtoH (Device -> Pageable)``).
DEVICE_TO_HOST = "Memcpy DtoH"
_STEP_RANGE = "gpu_check_step"


def site_in_package(stack: Iterable[traceback.FrameSummary]) -> str:
    """The innermost frame of ``stack`` in the dynamicemb package, as
    ``path:line function``, or ``outside dynamicemb``."""
    for frame in reversed(list(stack)):
        if os.path.abspath(frame.filename).startswith(_PACKAGE + os.sep):
            return f"{os.path.relpath(frame.filename, _PACKAGE)}:{frame.lineno} {frame.name}"
    return "outside dynamicemb"


def count_waiting_events(events: Iterable[Any], window: str = _STEP_RANGE) -> Dict[str, Any]:
    """The host waits and device-to-host copies among profiler ``events`` (objects
    with ``name`` and ``time_range.start``/``end`` in microseconds).

    Calls that wait are counted when they start inside the ``window`` range (a
    ``record_function`` around the step: the profiler's own closing synchronize
    falls after it); device-to-host copies when they start after its beginning.
    Without the window, everything is counted and ``window_found`` is False.

    Returns:
        ``{"waits": {name: count}, "wait_us": {name: total microseconds},
        "device_to_host": {copy name: count}, "window_found": bool}``.
    """
    events = list(events)
    marks = [e for e in events if e.name == window]
    start = min((e.time_range.start for e in marks), default=float("-inf"))
    end = max((e.time_range.end for e in marks), default=float("inf"))
    waits: Counter = Counter()
    wait_us: Counter = Counter()
    copies: Counter = Counter()
    for e in events:
        t = e.time_range.start
        if e.name in WAITING_CALLS and start <= t <= end:
            waits[e.name] += 1
            wait_us[e.name] += e.time_range.end - e.time_range.start
        elif e.name.startswith(DEVICE_TO_HOST) and t >= start:
            copies[e.name] += 1
    return {"waits": dict(waits), "wait_us": {k: round(v, 1) for k, v in wait_us.items()},
            "device_to_host": dict(copies), "window_found": bool(marks)}


def live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor Python can reach (each storage once).
    Sparse tensors (a static table's gradients) have no storage of their own: left out."""
    storages = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        storages[(str(storage.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


class Accelerator:
    """A CUDA GPU (the current device).

    Attributes:
        device: the device tensors and modules are made on.
        emulated: False (``EmulatedAccelerator``: True).
        capture_runs_step: whether capturing a step also runs it once (a CUDA
            capture records only; the stand-in runs it).
    """

    emulated = False
    capture_runs_step = False

    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """Within: work on a side stream ordered after the current one, and the
        current one ordered after it on exit (PyTorch's warm-up before a capture)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            yield
        current.wait_stream(side)

    def cpu_reference(self) -> contextlib.AbstractContextManager:
        """Within: ``device="cpu"`` takes the CPU backend (the reference to compare
        with; under the emulation, CPU tensors take the emulated CUDA path outside)."""
        return contextlib.nullcontext()

    def capture(self, step: Callable[[], Any]) -> Tuple[Any, Any]:
        """(graph, what ``step`` returned) of ``step`` captured in a CUDA graph;
        ``graph.replay()`` runs it again."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = step()
        return graph, result

    def sync_sites(self, step: Callable[[], Any]) -> Dict[str, Any]:
        """Every synchronizing call of ``step`` that ``set_sync_debug_mode("warn")``
        reports, by site in dynamicemb."""
        sites = []

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites.append(site_in_package(traceback.extract_stack()))

        self.synchronize()
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return {"count": len(sites), "sites": dict(Counter(sites))}

    def under_error_mode(self, step: Callable[[], Any]) -> str:
        """'ok' if ``step`` runs with every implicit sync an error, else the error."""
        self.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            return "ok"
        except RuntimeError as e:
            return f"{type(e).__name__}: {e}"[:500]
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _profile(self, step: Callable[[], Any]) -> Dict[str, Any]:
        from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

        activities = [ProfilerActivity.CPU]
        if not self.emulated:
            activities.append(ProfilerActivity.CUDA)
        self.synchronize()
        with profile(activities=activities) as prof:
            with record_function(_STEP_RANGE):
                step()
        return count_waiting_events(prof.events())

    def profiled_waits(self, step: Callable[[], Any]) -> Dict[str, Any]:
        """The CUDA calls of ``step`` that make the host wait, as the profiler
        (CUPTI) records them for every caller (PyTorch, CuPy), and its
        device-to-host copies: ``count_waiting_events``."""
        return self._profile(step)

    def held_bytes(self) -> Dict[str, int]:
        """What the process holds now (after a collection): reachable tensors' bytes
        (device rows, pinned host rows and host tensors alike) and PyTorch's
        allocated device memory."""
        gc.collect()
        torch.cuda.empty_cache()
        return {"tensors": live_tensor_bytes(),
                "cuda_allocated": int(torch.cuda.memory_allocated(self.device))}

    def count_launches(self) -> Counter:
        """A counter of this process's kernel launches by name, from now on."""
        kernels = for_device(self.device).kernels
        counter: Counter = Counter()
        launch = kernels._launch

        def counted(name, device, threads, *args, **kwargs):
            if threads > 0:
                counter[name] += 1
            return launch(name, device, threads, *args, **kwargs)

        kernels._launch = counted
        return counter


class EmulatedAccelerator(Accelerator):
    """The CPU, with CUDA-backend modules and tables on CPU tensors (their kernels
    emulated) and the graph stand-in for a capture.

    Args:
        kernels: the ``EmulatedCudaKernels`` of the enclosing ``emulated_cuda``.
    """

    emulated = True
    capture_runs_step = True

    def __init__(self, kernels, real_cpu: tuple) -> None:  # noqa: D107 (on the class)
        self.device = torch.device("cpu")
        self.kernels = kernels
        self._real_cpu = real_cpu

    @contextlib.contextmanager
    def cpu_reference(self) -> Iterator[None]:
        """Within: the CPU backend itself, the emulation's seams put back (a module
        built here keeps its backend, but its calls must run here too)."""
        emulated = _seams()
        _set_seams(self._real_cpu)
        try:
            yield
        finally:
            _set_seams(emulated)

    def name(self) -> str:
        return "cpu (CUDA path emulated)"

    def synchronize(self) -> None:
        pass

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        yield

    def capture(self, step: Callable[[], Any]) -> Tuple[Any, Any]:
        from dynamicemb_testing.graph_emulation import EmulatedGraph  # noqa: PLC0415

        graph = EmulatedGraph(self.kernels)
        with graph.capture():
            result = step()
        return graph, result

    def _guarded(self, step: Callable[[], Any]):
        from dynamicemb_testing.sync_guard import SyncGuard  # noqa: PLC0415

        with SyncGuard() as guard:
            self.kernels.guard = guard
            try:
                step()
            finally:
                self.kernels.guard = None
        return guard

    def sync_sites(self, step: Callable[[], Any]) -> Dict[str, Any]:
        """The synchronizing calls ``SyncGuard`` finds in ``step``, by site."""
        guard = self._guarded(step)
        sites = Counter(s.where.split("dynamicemb/", 1)[-1] for s in guard.syncs)
        return {"count": len(guard.syncs), "sites": dict(sites)}

    def under_error_mode(self, step: Callable[[], Any]) -> str:
        """'ok' if ``step`` makes no sync ``SyncGuard`` sees, else what it found."""
        guard = self._guarded(step)
        return "ok" if not guard.syncs else f"syncs: {guard.report()}"[:500]

    def held_bytes(self) -> Dict[str, int]:
        """Reachable tensors' bytes (after a collection; the emulation holds the
        tensors behind a launch's pointers only until the launch has run)."""
        gc.collect()
        return {"tensors": live_tensor_bytes()}

    def count_launches(self) -> Counter:
        """The emulation's own counter (it counts every launch), from now on."""
        self.kernels.launches.clear()
        return self.kernels.launches


@contextlib.contextmanager
def accelerator(emulated: bool = False) -> Iterator[Accelerator]:
    """The GPU, or with ``emulated`` the CPU with the CUDA path emulated (the test
    helpers of ``test/`` are put on the path for it) for the block."""
    if not emulated:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU, or pass --emulated")
        yield Accelerator()
        return
    test_dir = os.path.join(ROOT, "test")
    if test_dir not in sys.path:
        sys.path.insert(0, test_dir)
    from dynamicemb_testing.cuda_emulation import emulated_cuda  # noqa: PLC0415

    real_cpu = _seams()
    with emulated_cuda() as kernels:
        yield EmulatedAccelerator(kernels, real_cpu)


def _seams() -> tuple:
    """What ``emulated_cuda`` replaces: the CPU backend and the CUDA backend's
    pointer, device test and host allocation (``cuda_seams``)."""
    from dynamicemb import ops  # noqa: PLC0415
    from dynamicemb_testing.cuda_emulation import cuda_seams  # noqa: PLC0415

    return ops._cpu, cuda_seams()


def _set_seams(seams: tuple) -> None:
    from dynamicemb import ops  # noqa: PLC0415
    from dynamicemb_testing.cuda_emulation import set_cuda_seams  # noqa: PLC0415

    ops._cpu, cuda = seams
    set_cuda_seams(cuda)
