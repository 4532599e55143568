"""The CUDA backend's Python code run on CPU tensors, for CI machines without a GPU.

``emulated_cuda()`` makes ``dynamicemb.ops.for_device("cpu")`` return a
``CudaBackend`` whose kernel launches run on the CPU: each launch of a
``csrc/cuda`` kernel is counted and executed by the CPU extension's verb that
loops over the same per-key procedure (the shared headers of csrc/dynamicemb/),
where the two backends split the work alike; where they split it differently,
one launch runs the CPU verb and each launch writes its own kernel's outputs
(the cache's probe and rank: ``promotion_plan``; the backward's three kernels:
``sum_gradients`` and ``update_rows``, when the last one runs). Everything
between the launches (the sorts, scans, masks and copies ``dynamicemb/ops/cuda/``
and the layers above run around the kernels) is the real CUDA path's code, so a
``SyncGuard`` (``sync_guard.py``) sees the host synchronizations and aten ops a
GPU step would make.

Tensors reach the kernels as raw pointers; the emulation maps them back through
``_ptr``, which it wraps to remember the tensor behind each pointer until the
launch that takes it has run."""

import contextlib
import importlib
import os
import pkgutil
from collections import Counter
from typing import Dict, List, Optional

import numpy as np
import torch

import dynamicemb.ops as ops
from dynamicemb.ops import cpu_kernels, records
from dynamicemb.ops import cuda as cuda_backend

__all__ = ["EmulatedCudaKernels", "cuda_seams", "emulated_cuda", "real_cpu", "set_cuda_seams"]

# DEMB_TABLE_PARAMS: keys column, tids, digests, occupied, pinned, num_buckets, bc
_TABLE_ARGS = 7
# DEMB_ROW_PARAMS: device rows, host rows, width, row dtype, state offset, transient,
# dim, row_ref, and the computed rows' unique keys, table ids, init ints and init floats
_ROW_ARGS = 12
# kNoBucket of csrc/dynamicemb/hash_primitives.h: a padding position's bucket
_NO_BUCKET = 0x7FFFFFFF
_FAILED = 3  # InsertStatus.FAILED


class EmulatedCudaKernels(cuda_backend.CudaKernels):
    """``CudaKernels`` whose launches run on the CPU extension.

    Each ``run_<kernel>`` maps the launch's arguments back to tensors and calls the
    CPU verb that loops over the same per-key procedure (csrc/dynamicemb/); the
    kernels with no CPU verb of their own (the dedup set's two, the backward's
    pieces) are a few torch ops.

    Attributes:
        launches: kernel name -> launches so far.
        configs: (kernel name, threads, block, dynamic shared bytes) of every launch.
        argument_types: kernel name -> every tuple of argument types it was given.
        guard: a ``SyncGuard`` (or None), paused while an emulated kernel runs.
        host_allocations: (shape, dtype) of every ``mapped_host_zeros`` allocation.
    """

    def __init__(self) -> None:  # no CuPy: nothing is compiled
        self.launches: Counter = Counter()
        self.configs: list = []
        self.argument_types: Dict[str, set] = {}
        self.guard = None
        self.host_allocations: list = []
        # the stream API (``dynamicemb.ops.streams``): none on a CPU; a test gives one
        self.stream_api = None
        self._cpu = cpu_kernels.load()
        # pointer -> tensor: the pointers taken and not yet handed to a launch
        # (each launch takes its own), then those of the launch in flight
        self._tensors: Dict[int, torch.Tensor] = {}
        self._launched: Dict[int, torch.Tensor] = {}
        # what one launch leaves for the next: demb_cache_probe's inputs for
        # demb_cache_rank, demb_place_grads' lookups for demb_fused_update
        self._probed: Optional[list] = None
        self._placed: Optional[tuple] = None

    def mapped_host_zeros(self, shape, dtype, device) -> torch.Tensor:
        """Stands in for the pinned, GPU-mapped host memory: plain zeros, recorded."""
        self.host_allocations.append((tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype, device=device)

    # ------------------------------------------------------------ plumbing
    def remember(self, t: Optional[torch.Tensor]) -> np.uint64:
        """``cuda._ptr`` that remembers which tensor a pointer stands for, until a
        launch takes it."""
        if t is not None and t.numel():
            self._tensors[t.data_ptr()] = t
        return _REAL_PTR(t)

    def tensors_of(self, args: list) -> Dict[int, torch.Tensor]:
        """The tensors behind the pointers of a launch about to be made."""
        return {int(x): self._tensors[int(x)] for x in args
                if isinstance(x, np.uint64) and int(x) in self._tensors}

    def _t(self, ptr) -> Optional[torch.Tensor]:
        """The tensor of a pointer argument of the launch in flight (None: null)."""
        if not int(ptr):
            return None
        if int(ptr) not in self._launched:
            raise AssertionError(f"a pointer no tensor of this launch stands for: {int(ptr):#x}")
        return self._launched[int(ptr)]

    def _ids(self, ptr) -> torch.Tensor:
        """An int64 array argument, empty where the launch passed none (null)."""
        t = self._t(ptr)
        return t if t is not None else torch.empty(0, dtype=torch.int64)

    def _meta(self, args: list, first: int = 0) -> List[torch.Tensor]:
        """A table's meta list from its DEMB_TABLE_PARAMS at ``args[first:]``."""
        keys = self._t(args[first])
        scores = torch.as_strided(keys, keys.shape, keys.stride(), keys.storage_offset() + 1)
        return [keys, scores] + [self._t(args[first + i]) for i in range(1, 5)]

    def _tiers(self, args: list) -> list:
        """[device values, host values] from device rows, host rows and width at
        ``args[0:3]`` (an empty (0, width) array for a null tier)."""
        empty = torch.empty(0, int(args[2]), dtype=torch.float32)
        return [empty if t is None else t for t in (self._t(args[0]), self._t(args[1]))]

    def _rows(self, args: list) -> dict:
        """The row arguments of the CPU's lookups from DEMB_ROW_PARAMS at ``args[0:12]``:
        tiers, row_format, transient, row_ref, dim and init (the computed rows'
        InitRows)."""
        dim, transient = int(args[6]), self._t(args[5])
        row_ref = self._ids(args[7])
        init = None
        if int(args[10]) and row_ref.numel():
            init = (self._t(args[8]), self._t(args[9]), (self._t(args[10]), self._t(args[11])))
        return {"tiers": self._tiers(args), "row_format": (int(args[3]), int(args[4])),
                "transient": torch.empty(0, dim) if transient is None else transient,
                "row_ref": row_ref, "dim": dim, "init": init}

    @staticmethod
    def _refused(error) -> bool:
        return error is not None and int(error[0]) != 0

    def _launch(self, name: str, device: torch.device, threads: int, args: list,
                shared_mem: int = 0, block: int = cuda_backend._BLOCK) -> None:
        launched = self.tensors_of(args)
        for ptr in launched:
            del self._tensors[ptr]
        if threads <= 0:
            return
        self.launches[name] += 1
        self.configs.append((name, threads, block, shared_mem))
        self.argument_types.setdefault(name, set()).add(tuple(type(x) for x in args))
        context = self.guard.paused() if self.guard is not None else contextlib.nullcontext()
        with context:
            self._execute(name, args, launched, threads, block, shared_mem)

    def _execute(self, name: str, args: list, launched: Dict[int, torch.Tensor], threads: int,
                 block: int, shared_mem: int) -> None:
        """Runs one launch (``launched``: its pointers' tensors): here the kernel's CPU
        verb (``run_<kernel>``)."""
        self._launched = launched
        try:
            getattr(self, "run_" + name[len("demb_"):])(args)
        finally:
            self._launched = {}

    # ---------------------------------------------------------- hash table
    def run_hash_keys(self, a):
        self._t(a[3]).copy_(self._cpu.hash_keys(self._t(a[0]), self._t(a[1])))

    def run_buckets_of(self, a):
        hashes = self._cpu.hash_keys(self._t(a[0]), self._t(a[1]))
        self._t(a[4]).copy_(torch.bitwise_and(hashes, int(a[3]) - 1))

    def run_find(self, a):
        t = _TABLE_ARGS
        slots = self._cpu.find(self._meta(a), int(a[6]), self._t(a[t]), self._t(a[t + 1]),
                               bool(a[t + 3]))
        self._t(a[t + 4]).copy_(slots)

    def run_upsert(self, a):
        t = _TABLE_ARGS
        m = int(a[t + 8])
        keys, tids, given = self._t(a[t])[:m], self._t(a[t + 1])[:m], self._t(a[t + 2])
        given = None if given is None else given[:m]
        rule, evicts, one_table = int(a[t + 3]), bool(a[t + 4]), bool(a[t + 5])
        # the buckets in input order (a key of bucket kNoBucket is skipped); the CPU
        # walks each bucket's keys in input order, as the warps walk their runs
        order = self._t(a[t + 7])[:m]
        buckets = torch.empty(m, dtype=torch.int32)
        buckets[order] = self._t(a[t + 6])[:m]
        outcomes, now_at, size = self._t(a[t + 15]), self._t(a[t + 16]), self._t(a[t + 17])
        table_scores, ttl = self._t(a[t + 18]), int(a[t + 19])
        if table_scores is not None:  # the given rule's scores by table id
            given = table_scores[tids.long()]
        time = None if now_at is None else now_at[:1].repeat(2)
        outs = self._cpu.upsert(self._meta(a), int(a[6]), keys, tids, given, rule, evicts,
                                one_table, buckets, outcomes, size, time=time, ttl=ttl)
        for out, got in zip((self._t(x) for x in a[t + 9:t + 15]), outs):
            out[:m] = got

    def run_undo_upsert(self, a):
        t = _TABLE_ARGS
        self._cpu.undo_upsert(self._meta(a), int(a[6]), *[self._t(x) for x in a[t:t + 6]])

    def run_grow(self, a):
        moved = self._cpu.grow(self._meta(a), self._meta(a, _TABLE_ARGS), int(a[6]))
        self._t(a[_TABLE_ARGS + 5]).copy_(moved)

    def run_expire(self, a):
        t = _TABLE_ARGS
        time_mask = int(np.array(a[t], dtype=np.uint64).view(np.int64))
        expired = self._cpu.expire(self._meta(a), int(a[6]), time_mask, int(a[t + 1]))
        self._t(a[t + 2]).copy_(expired)

    def run_erase_where(self, a):
        t = _TABLE_ARGS
        self._cpu.erase_where(self._meta(a), int(a[6]), *(self._t(a[t + i]) for i in range(3)),
                              int(a[t + 3]), self._t(a[t + 5]), self._t(a[t + 6]))

    def run_erase(self, a):
        t = _TABLE_ARGS
        erased = self._cpu.erase(self._meta(a), int(a[6]), self._t(a[t]), self._t(a[t + 1]))
        self._t(a[t + 3]).copy_(erased)

    # --------------------------------------------------------------- cache
    # The CPU's promotion_plan is the probe and the rank in one; the rank needs the
    # cache's size, which only demb_cache_rank is given: each launch runs it on the
    # probe's inputs and writes its own kernel's outputs.
    def run_cache_probe(self, a):
        t = _TABLE_ARGS
        self._probed = ([self._meta(a), int(a[6])] + [self._t(a[t + i]) for i in range(4)]
                        + [bool(a[t + 5])])
        cache_slots, plan, _, _ = self._cpu.promotion_plan(
            *self._probed, torch.zeros(1, dtype=torch.int64))  # the counts need no size
        self._t(a[t + 6]).copy_(cache_slots)
        self._t(a[t + 7])[:3] += plan[:3]

    def run_cache_rank(self, a):
        probed, self._probed = self._probed, None
        if int(a[3]) == 0:  # no key: nothing taken, no rank
            return
        if probed is None or probed[4] is not self._t(a[0]):
            raise AssertionError("demb_cache_rank runs on the batch of the probe before it")
        _, plan, rank, _ = self._cpu.promotion_plan(*probed, self._t(a[5]))
        self._t(a[6])[3] = plan[3]
        self._t(a[7]).copy_(rank)

    def run_promotion_order(self, a):
        outs = self._cpu.promotion_order(*(self._t(a[i]) for i in range(5)), self._t(a[6]),
                                         int(a[7]))
        for i, out in enumerate(outs):
            self._t(a[8 + i]).copy_(out)

    def run_promote_rows(self, a):
        self._cpu.promote_rows(self._meta(a), int(a[6]), self._t(a[7]), self._t(a[8]),
                               *(self._t(a[i]) for i in range(10, 16)), self._t(a[17]))

    # --------------------------------------------------------------- dedup
    def run_dedup_insert(self, a):
        # where: each position's first position (a GPU writes its set slot, which
        # demb_dedup_first turns into that), -1 for the positions of other groups
        groups = self._t(a[6])
        part = None if groups is None else records.BatchPart(groups, int(a[7]))
        inverse = self._cpu.dedup(self._t(a[0]), self._t(a[1]), None, part=part)[2]
        n, mine = inverse.numel(), inverse >= 0
        first = torch.full((n,), n, dtype=torch.int64).scatter_reduce_(
            0, inverse[mine], torch.arange(n)[mine], "amin")
        self._t(a[5]).copy_(torch.where(mine, first[inverse.clamp(min=0)], -1))

    def run_dedup_first(self, a):
        first = self._t(a[3])
        first.copy_(self._t(a[1]))
        self._t(a[4]).copy_(first == torch.arange(first.numel()))

    def run_dedup_number(self, a):
        keys, tids, first = (self._t(a[i]) for i in range(3))
        ukeys, utids, inverse, occurrences = (self._t(a[i]) for i in range(5, 9))
        buckets, error, time = self._t(a[10]), self._t(a[11]), self._t(a[12])
        if time is not None and not self._refused(error):  # the table's clock and step
            time += 1
        if int(a[4]) == 0:  # an empty batch: the launch only ticks
            return
        kept = records.BatchPart((first >= 0).long(), 1)  # first -1: another group's
        unique_keys, unique_tids, inv, counts, _, _ = self._cpu.dedup(
            keys, tids, error, part=kept)
        inverse.copy_(inv)
        # the pairs (count > 0) and the padding past them (key 0, table 0, no bucket)
        u = int(a[4])
        ukeys[:u] = unique_keys[:u]
        utids[:u] = unique_tids[:u]
        occurrences[:u] += counts[:u]
        if buckets is not None:  # given for an inserting pass over the unique pairs
            bucket = torch.bitwise_and(self._cpu.hash_keys(ukeys[:u], utids[:u]), int(a[9]) - 1)
            buckets[:u] = torch.where(counts[:u] > 0, bucket, _NO_BUCKET)

    # ----------------------------------------------------------- embedding
    def run_check_offsets(self, a):
        self._cpu.check_offsets(self._t(a[0]), int(a[2]), error=self._t(a[3]))

    def run_init_rows(self, a):
        spec = records.InitSpec(self._t(a[10]), self._t(a[11]))
        self._cpu.init_rows(self._t(a[0]), *(self._t(a[i]) for i in range(4, 8)), int(a[9]),
                            spec, float(a[12]), row_format=(int(a[2]), int(a[3])))

    def run_pooled_forward(self, a):
        r = _ROW_ARGS
        self._cpu.pooled_forward(
            **self._rows(a), inverse=self._ids(a[r]), offsets=self._t(a[r + 1]),
            weights=self._t(a[r + 2]), feature_col=self._t(a[r + 3]), batch=int(a[r + 4]),
            mean=bool(a[r + 6]), out=self._t(a[r + 7]), error=self._t(a[r + 9]))

    def run_sequence_forward(self, a):
        r = _ROW_ARGS
        self._cpu.sequence_forward(**self._rows(a), inverse=self._ids(a[r]),
                                   out=self._t(a[r + 2]), error=self._t(a[r + 3]))

    def run_per_sample_weight_grad(self, a):
        r = _ROW_ARGS
        if self._t(a[r + 7]) is None:  # bags without lookups: nothing to write
            return
        self._cpu.per_sample_weight_grad(
            **self._rows(a), inverse=self._ids(a[r]), offsets=self._t(a[r + 1]),
            feature_col=self._t(a[r + 2]), batch=int(a[r + 3]), grad=self._t(a[r + 5]),
            out=self._t(a[r + 7]), error=self._t(a[r + 8]))

    # The backward's gradients are summed and applied by the CPU's two backward
    # passes (sum_gradients, update_rows) when demb_fused_update runs, over the
    # lookups demb_place_grads was given; the piece kernels leave that to them.
    def run_place_grads(self, a):
        refused = self._refused(self._t(a[13]))
        step = self._t(a[14])
        if step is not None and not refused:  # the optimizer's step count
            step += 1
        offsets = self._t(a[3])
        self._placed = None if refused else (
            self._t(a[0]), torch.empty(0, dtype=torch.int64) if offsets is None else offsets,
            self._t(a[4]), self._t(a[5]), int(a[6]), bool(a[8]))

    def run_piece_counts(self, a):
        starts, num_unique, piece = self._t(a[0]), int(a[1]), int(a[2])
        entries = starts[1:num_unique + 1] - starts[:num_unique]
        if num_unique:
            self._t(a[3]).copy_(torch.where(entries > piece, (entries + piece - 1) // piece, 0))
        self._t(a[4])[0] = 0

    def run_piece_sums(self, a):
        pass

    def run_fused_update(self, a):
        placed, self._placed = self._placed, None
        if placed is None:  # a refused batch: nothing placed, nothing updated
            return
        rank, offsets, weights, feature_col, batch, mean = placed
        row_format, dim, starts = (int(a[3]), int(a[4])), int(a[5]), self._t(a[8])
        # rows with no entry are padding (the kernel skips them), all after the real ones
        num_unique = int((starts[1:int(a[7]) + 1] > starts[:int(a[7])]).sum())
        sums = torch.empty(num_unique, dim, dtype=torch.float32)
        self._cpu.sum_gradients(starts[:num_unique + 1], rank, offsets, weights, feature_col,
                                batch, mean, self._t(a[11]), sums)
        schedule = None if not int(a[25]) else (  # read from device memory
            self._t(a[25]), self._t(a[26]), False, float(a[27]), float(a[28]), float(a[29]))
        rounding = None if not int(a[30]) else (  # its step read after place_grads' advance
            self._t(a[30]), self._t(a[31]), self._t(a[32]), self._t(a[33]), bool(a[34]))
        self._cpu.update_rows(
            self._tiers(a), self._t(a[6])[:num_unique], sums,
            # beta as 1 - the kernel's (1 - beta): the float32 1 - beta the kernel
            # multiplies by is what a float32 beta would lose 1e-5 of
            int(a[14]), float(a[15]), float(a[16]), 1.0 - float(a[20]), 1.0 - float(a[21]),
            float(a[19]), float(a[22]), float(a[23]), float(a[24]), schedule=schedule,
            row_format=row_format, rounding=rounding)


_REAL_PTR = cuda_backend._ptr

# What the emulation replaces in the CUDA backend: the pointer of a tensor, the test
# of a tensor's device and the host allocation. Each module of ``dynamicemb.ops.cuda``
# binds the ones it uses, so each is replaced in every module that holds it.
_SEAM_NAMES = ("_ptr", "_on_kernel_device", "mapped_host_zeros")


def cuda_seams() -> dict:
    """The CUDA backend's seams as they are now: {(module, name): value}."""
    modules = [cuda_backend] + [
        importlib.import_module(f"{cuda_backend.__name__}.{info.name}")
        for info in pkgutil.iter_modules(cuda_backend.__path__)]
    return {(module, name): getattr(module, name)
            for module in modules for name in _SEAM_NAMES if hasattr(module, name)}


def set_cuda_seams(seams: dict) -> None:
    """Puts back seams that ``cuda_seams`` returned."""
    for (module, name), value in seams.items():
        setattr(module, name, value)


_REAL_CPU = ops._cpu


def _default_kernels() -> EmulatedCudaKernels:
    mode = os.environ.get("DEMB_CUDA_EMULATION", "verbs")
    if mode == "simt":
        from dynamicemb_testing.simt import SimtCudaKernels  # noqa: PLC0415

        return SimtCudaKernels()
    if mode != "verbs":
        raise ValueError(f"DEMB_CUDA_EMULATION must be 'verbs' or 'simt', got {mode!r}")
    return EmulatedCudaKernels()


@contextlib.contextmanager
def real_cpu():
    """Within ``emulated_cuda``: what is built here (a table, a module) binds the CPU
    backend, as a twin of what the emulation runs."""
    emulated, ops._cpu = ops._cpu, _REAL_CPU
    try:
        yield
    finally:
        ops._cpu = emulated


@contextlib.contextmanager
def emulated_cuda(kernels: Optional[EmulatedCudaKernels] = None):
    """Within: CPU tensors take the CUDA backend's path, kernels emulated on the CPU.

    Args:
        kernels: the emulation to use again (modules built under an earlier
            ``emulated_cuda`` keep its backend); default a new one: the CPU verbs'
            (``EmulatedCudaKernels``), or with ``DEMB_CUDA_EMULATION=simt`` the
            kernels' own source (``simt.SimtCudaKernels``).

    Yields:
        The ``EmulatedCudaKernels`` (its ``launches`` count every kernel launch).
    """
    if kernels is None:
        kernels = _default_kernels()
    backend = cuda_backend.CudaBackend.__new__(cuda_backend.CudaBackend)
    cuda_backend.KernelBackend.__init__(backend, kernels)
    saved_cpu, saved = ops._cpu, cuda_seams()
    emulated = {"_ptr": kernels.remember,
                "_on_kernel_device": lambda t: t.device.type == "cpu",
                "mapped_host_zeros": kernels.mapped_host_zeros}
    ops._cpu = lambda: backend
    set_cuda_seams({(module, name): emulated[name] for module, name in saved})
    try:
        yield kernels
    finally:
        ops._cpu = saved_cpu
        set_cuda_seams(saved)
