"""The CUDA backend's Python code run on CPU tensors, for CI machines without a GPU.

``emulated_cuda()`` makes ``dynamicemb.ops.for_device("cpu")`` return a
``CudaBackend`` whose kernel launches run on the CPU: each launch of a
``csrc/cuda`` kernel is counted and executed by the CPU extension's verb with
the same per-key contract (or, for the backward's three kernels, by the CPU's
two backward passes, ``sum_gradients`` and ``update_rows``, over the arguments they
were given). Everything between the
launches (the sorts, scans, masks and copies ``dynamicemb/ops/cuda/`` and the
layers above run around the kernels) is the real CUDA path's code, so a
``SyncGuard`` (``sync_guard.py``) sees the host synchronizations and aten ops a GPU
step would make.

Tensors reach the kernels as raw pointers; the emulation maps them back through
``_ptr``, which it wraps to remember the tensor behind each pointer of a launch.
"""

import contextlib
import importlib
import math
import pkgutil
from collections import Counter
from typing import Dict, List, Optional

import numpy as np
import torch

import dynamicemb.ops as ops
from dynamicemb.ops import cpu_kernels
from dynamicemb.ops import cuda as cuda_backend

__all__ = ["EmulatedCudaKernels", "cuda_seams", "emulated_cuda", "set_cuda_seams"]

# DEMB_TABLE_PARAMS: keys column, tids, digests, occupied, pinned, num_buckets, bc
_TABLE_ARGS = 7
# DEMB_ROW_PARAMS: device rows, host rows, width, transient, dim, row_ref, and the
# computed rows' unique keys, table ids, init ints and init floats
_ROW_ARGS = 10
# kNoBucket of csrc/dynamicemb/hash_primitives.h: a padding position's bucket
_NO_BUCKET = 0x7FFFFFFF
_FAILED = 3  # InsertStatus.FAILED


class EmulatedCudaKernels(cuda_backend.CudaKernels):
    """``CudaKernels`` whose launches run on the CPU extension.

    Attributes:
        launches: kernel name -> launches so far.
        configs: (kernel name, threads, block, dynamic shared bytes) of every launch.
        argument_types: kernel name -> every tuple of argument types it was given.
        guard: a ``SyncGuard`` (or None), paused while an emulated kernel runs.
    """

    def __init__(self) -> None:  # no CuPy: nothing is compiled
        self.launches: Counter = Counter()
        self.configs: list = []
        # kernel name -> the tuples of argument types its launches passed
        self.argument_types: Dict[str, set] = {}
        self.guard = None
        self._cpu = cpu_kernels.load()
        self._tensors: Dict[int, torch.Tensor] = {}
        self._placed: Optional[list] = None  # the last demb_place_grads arguments
        # (shape, dtype) of every host-memory allocation (``mapped_host_zeros``)
        self.host_allocations: list = []

    def mapped_host_zeros(self, shape, dtype, device) -> torch.Tensor:
        """Stands in for the pinned, GPU-mapped host memory: plain zeros, recorded."""
        self.host_allocations.append((tuple(shape), dtype))
        return torch.zeros(shape, dtype=dtype, device=device)

    # ------------------------------------------------------------ plumbing
    def remember(self, t: Optional[torch.Tensor]) -> np.uint64:
        """``cuda._ptr`` that remembers which tensor a pointer stands for."""
        if t is not None and t.numel():
            self._tensors[t.data_ptr()] = t
        return _REAL_PTR(t)

    def _t(self, ptr) -> Optional[torch.Tensor]:
        return self._tensors.get(int(ptr)) if int(ptr) else None

    def _ids(self, ptr) -> torch.Tensor:
        """An int64 array argument, empty where the launch passed none (null)."""
        t = self._t(ptr)
        return t if t is not None else torch.empty(0, dtype=torch.int64)

    def _meta(self, args: list, first: int = 0) -> List[torch.Tensor]:
        """A table's meta list from its DEMB_TABLE_PARAMS at ``args[first:]``."""
        keys = self._t(args[first])
        scores = torch.as_strided(keys, keys.shape, keys.stride(), keys.storage_offset() + 1)
        return [keys, scores] + [self._t(args[first + i]) for i in range(1, 5)]

    def _rows(self, args: list):
        """(tiers, transient, dim, row_ref) from DEMB_ROW_PARAMS at ``args[0:10]``. Rows
        the kernel would compute from the initializers (negative references when the
        init arrays are given) become transient rows of the CPU's ``init_rows``."""
        width, dim = int(args[2]), int(args[4])
        empty = torch.empty(0, width, dtype=torch.float32)
        device, host = self._t(args[0]), self._t(args[1])
        transient, row_ref = self._t(args[3]), self._ids(args[5])
        if int(args[8]) and row_ref.numel():  # computed rows: a transient row per unique row
            keys, tids = self._t(args[6]), self._t(args[7])
            transient = torch.zeros(row_ref.numel(), dim)
            self._init(transient, torch.arange(row_ref.numel()), keys, tids, dim,
                       self._t(args[8]), self._t(args[9]))
            row_ref = torch.where(row_ref < 0, -(torch.arange(row_ref.numel()) + 1), row_ref)
        return ([device if device is not None else empty, host if host is not None else empty],
                transient if transient is not None else torch.empty(0, dim), dim, row_ref)

    def _init(self, out, rows, keys, tids, dim, ints, floats) -> None:
        """out[rows[i], :dim] = key i's initial row in its table (packed InitSpec)."""
        for table, ((stream, mode, seed), (mean, std, lower, upper, value)) in enumerate(
                zip(ints.tolist(), floats.tolist())):
            mine = (tids.long() == table).nonzero().squeeze(1)
            if mine.numel():
                self._cpu.init_rows(out, rows[mine].contiguous(), keys[mine].contiguous(),
                                    stream, dim, mode, mean, std, lower, upper, value, seed)

    @staticmethod
    def _refused(error) -> bool:
        return error is not None and int(error[0]) != 0

    def _launch(self, name: str, device: torch.device, threads: int, args: list,
                shared_mem: int = 0, block: int = cuda_backend._BLOCK) -> None:
        if threads <= 0:
            return
        self.launches[name] += 1
        self.configs.append((name, threads, block, shared_mem))
        self.argument_types.setdefault(name, set()).add(tuple(type(x) for x in args))
        run = getattr(self, "run_" + name[len("demb_"):])
        context = self.guard.paused() if self.guard is not None else contextlib.nullcontext()
        with context:
            run(args)

    # ---------------------------------------------------------- hash table
    def run_hash_keys(self, a):
        self._t(a[3]).copy_(self._cpu.hash_keys(self._t(a[0]), self._t(a[1])))

    def run_buckets_of(self, a):
        keys, tids, pending = self._t(a[0]), self._t(a[1]), self._t(a[2])
        if pending is not None:  # a null pointer: every key
            keys, tids = keys[pending], tids[pending]
        hashes = self._cpu.hash_keys(keys, tids)
        self._t(a[5]).copy_(torch.bitwise_and(hashes, int(a[4]) - 1))

    def run_find(self, a):
        t = _TABLE_ARGS
        slots = self._cpu.find(self._meta(a), int(a[6]), self._t(a[t]), self._t(a[t + 1]),
                               bool(a[t + 3]))
        self._t(a[t + 4]).copy_(slots)

    def run_upsert(self, a):
        t = _TABLE_ARGS
        keys, tids, given = self._t(a[t]), self._t(a[t + 1]), self._t(a[t + 2])
        rule, now = int(a[t + 3]), int(np.int64(a[t + 4]))
        now_at = self._t(a[t + 19])
        if now_at is not None:  # the time in device memory
            now = int(now_at[0])
        evicts, can_grow, one_table = bool(a[t + 5]), bool(a[t + 6]), bool(a[t + 7])
        # The runs are bucket-sorted positions; the CPU walks them in the given order,
        # so every bucket sees its keys in input order as the warps do.
        order, m = self._t(a[t + 9]), int(a[t + 10])
        outs = [self._t(x) for x in a[t + 11:t + 17]]
        outcomes, deferred_count = self._t(a[t + 17]), self._t(a[t + 18])
        # padding positions (bucket kNoBucket): slot -1, FAILED, counted nowhere
        padding = self._t(a[t + 8])[:m] == _NO_BUCKET
        outs[0][order[:m][padding]] = -1
        outs[1][order[:m][padding]] = _FAILED
        counts = torch.zeros(4, dtype=torch.int64)
        deferred = self._cpu.upsert(self._meta(a), int(a[6]), keys, tids, given, rule, now,
                                    evicts, can_grow, one_table,
                                    order[:m][~padding].contiguous(), *outs, counts)
        outcomes += counts
        size = self._t(a[t + 20])
        if size is not None:  # the table's size on the device: its inserts into empty slots
            size += counts[1]
        if deferred_count is not None:
            deferred_count += deferred.numel()
        elif deferred.numel():
            raise AssertionError("a pass deferred keys with no counter for them")

    def run_unpin(self, a):
        self._cpu.unpin(self._meta(a), int(a[6]), self._t(a[_TABLE_ARGS]))

    def run_undo_upsert(self, a):
        t = _TABLE_ARGS
        self._cpu.undo_upsert(self._meta(a), int(a[6]), *[self._t(x) for x in a[t:t + 6]])

    def run_grow(self, a):
        old = self._meta(a)
        new = self._meta(a, _TABLE_ARGS)[:6]
        moved = self._cpu.grow(old, new, int(a[6]))
        self._t(a[_TABLE_ARGS + 5]).copy_(moved)

    def run_expire(self, a):
        t = _TABLE_ARGS
        time_mask = int(np.array(a[t], dtype=np.uint64).view(np.int64))
        expired = self._cpu.expire(self._meta(a), int(a[6]), time_mask, int(a[t + 1]))
        self._t(a[t + 2]).copy_(expired)

    def run_erase_where(self, a):
        t = _TABLE_ARGS
        keys, tids, status = self._t(a[t]), self._t(a[t + 1]), self._t(a[t + 2])
        n = int(a[t + 4])
        at = (status[:n] == int(a[t + 3])).nonzero().squeeze(1)
        if at.numel():
            count = int(self._cpu.erase(self._meta(a), int(a[6]), keys[at].contiguous(),
                                        tids[at].contiguous()).sum())
            self._t(a[t + 5])[0] += count
            self._t(a[t + 6])[0] -= count

    # --------------------------------------------------------------- cache
    def run_cache_probe(self, a):
        t = _TABLE_ARGS
        keys, tids, counts, host_slots = (self._t(a[t + i]) for i in range(4))
        n, one_table = int(a[t + 4]), bool(a[t + 5])
        cache_slots, plan = self._t(a[t + 6]), self._t(a[t + 7])
        found = self._cpu.find(self._meta(a), int(a[6]), keys[:n], tids[:n], one_table)
        real = (counts[:n] > 0) & (host_slots[:n] >= 0)
        cache_slots[:n] = torch.where(real, found, -1)
        miss = real & (found < 0)
        plan[0] += int((real & (found >= 0)).sum())
        plan[1] += int(miss.sum())
        plan[2] += int((miss & (counts[:n] > 1)).sum())

    def run_cache_rank(self, a):
        counts, host_slots, cache_slots = self._t(a[0]), self._t(a[1]), self._t(a[2])
        n, capacity, size = int(a[3]), int(a[4]), int(self._t(a[5])[0])
        plan, rank = self._t(a[6]), self._t(a[7])
        hits, misses, hot = (int(v) for v in plan[:3])
        overflow = misses > capacity - size
        plan[3] = hits + (min(hot, max(capacity - hits, 0)) if overflow else misses)
        if n == 0:
            return
        counts, host_slots, cache_slots = counts[:n], host_slots[:n], cache_slots[:n]
        miss_rank = (torch.where(counts > 1, counts, -1) if overflow
                     else torch.zeros_like(counts))
        rank[:n] = torch.where((counts <= 0) | (host_slots < 0), -2,
                               torch.where(cache_slots >= 0, torch.iinfo(torch.int64).max,
                                           miss_rank))

    def run_promotion_order(self, a):
        order, keys, tids, host_slots, host_keys = (self._t(a[i]) for i in range(5))
        n, taken, num_buckets = int(a[5]), int(self._t(a[6])[3]), int(a[7])
        out_keys, out_tids, out_scores, buckets = (self._t(a[i]) for i in range(8, 12))
        scores = torch.as_strided(host_keys, host_keys.shape, host_keys.stride(),
                                  host_keys.storage_offset() + 1)
        i = order[:n]
        slot = host_slots[i]
        out_keys[:n], out_tids[:n] = keys[i], tids[i]
        out_scores[:n] = torch.where(slot >= 0, scores[slot.clamp(min=0)], 0)
        bucket = torch.bitwise_and(self._cpu.hash_keys(keys[i].contiguous(),
                                                       tids[i].contiguous()), num_buckets - 1)
        buckets[:n] = torch.where(torch.arange(n) < taken, bucket, _NO_BUCKET).to(torch.int32)

    def run_promote_rows(self, a):
        host_values, cache_values = self._t(a[7]), self._t(a[8])
        order, host_slots, slots, status = (self._t(a[i]) for i in range(10, 14))
        ev_keys, ev_tids, n, refs = self._t(a[14]), self._t(a[15]), int(a[16]), self._t(a[17])
        status, slots = status[:n], slots[:n]
        victims = (status == 2).nonzero().squeeze(1)
        if victims.numel():  # written back first: their slots take the new rows next
            home = self._cpu.find(self._meta(a), int(a[6]), ev_keys[victims].contiguous(),
                                  ev_tids[victims].contiguous(), False)
            found = home >= 0
            host_values[home[found]] = cache_values[slots[victims][found]]
        new = ((status == 1) | (status == 2)).nonzero().squeeze(1)
        if new.numel():
            cache_values[slots[new]] = host_values[host_slots[order[new]]]
        i = order[:n]
        hs = host_slots[i]
        refs[i] = torch.where(slots >= 0, slots, torch.where(hs >= 0, hs + (1 << 62), -1))

    def run_erase(self, a):
        t = _TABLE_ARGS
        erased = self._cpu.erase(self._meta(a), int(a[6]), self._t(a[t]), self._t(a[t + 1]))
        self._t(a[t + 3]).copy_(erased)

    # --------------------------------------------------------------- dedup
    def run_dedup_insert(self, a):
        keys, tids, n = self._t(a[0]), self._t(a[1]), int(a[2])
        groups = self._t(a[6])  # with a group: other groups' positions are left out (-1)
        at = (torch.arange(n) if groups is None
              else (groups[:n] == int(a[7])).nonzero().squeeze(1))
        _, _, inverse, _, _, _ = self._cpu.dedup(keys[at].contiguous(), tids[at].contiguous(),
                                                 None, False)
        first = torch.full((at.numel(),), n, dtype=torch.int64).scatter_reduce_(
            0, inverse, at, "amin")
        where = self._t(a[5])
        where.fill_(-1)
        where[at] = first[inverse]

    def run_dedup_first(self, a):
        first = self._t(a[3])
        first.copy_(self._t(a[1]))
        self._t(a[4]).copy_(first == torch.arange(first.numel()))

    def run_dedup_number(self, a):
        keys, tids, first, number = (self._t(a[i]) for i in range(4))
        ukeys, utids, inverse, occurrences = (self._t(a[i]) for i in range(5, 9))
        buckets, padded, refused = self._t(a[10]), bool(a[11]), self._refused(self._t(a[12]))
        time = self._t(a[13])
        if time is not None and not refused:  # the table's clock and step
            time += 1
        if int(a[4]) == 0:  # an empty batch: the launch only ticks
            return
        if padded:  # past the unique count: key 0, table 0, no bucket
            u = 0 if refused else int(number[-1])
            ukeys[u:] = 0
            utids[u:] = 0
            if buckets is not None:
                buckets[u:] = _NO_BUCKET
        if refused:
            inverse.fill_(-1)
            return
        mine = first >= 0  # other groups' positions: inverse -1
        inverse.copy_(torch.where(mine, number[first.clamp(min=0)] - 1, -1))
        if occurrences is not None:  # None: no unique pair (n = 0 launches nothing)
            occurrences.index_add_(0, inverse[mine], torch.ones_like(inverse[mine]))
        is_first = first == torch.arange(first.numel())
        u = int(is_first.sum())
        ukeys[:u] = keys[is_first]
        utids[:u] = tids[is_first]
        if buckets is not None:  # given for an inserting pass over the unique pairs
            buckets[:u] = torch.bitwise_and(self._cpu.hash_keys(ukeys[:u], utids[:u]),
                                            int(a[9]) - 1)

    # ----------------------------------------------------------- embedding
    def run_check_offsets(self, a):
        code = self._cpu.check_offsets(self._t(a[0]), int(a[2]))
        error = self._t(a[3])  # keeps max(4 - code): the smallest code wins
        if code:
            error.copy_(torch.maximum(error, torch.tensor([4 - code])))

    def run_init_new_rows(self, a):
        values, slots, status = self._t(a[0]), self._t(a[2]), self._t(a[3])
        keys, tids, dim = self._t(a[4]), self._t(a[5]), int(a[7])
        new = ((status == 1) | (status == 2)).nonzero().squeeze(1)
        if new.numel():
            self._init(values, slots[new], keys[new], tids[new], dim, self._t(a[8]),
                       self._t(a[9]))
            values[slots[new], dim:] = float(a[10])

    def run_init_rows(self, a):
        out, rows, keys = self._t(a[0]), self._t(a[2]), self._t(a[3])
        m = int(a[4])
        seed = int(np.array(a[13], dtype=np.uint64).view(np.int64))
        self._cpu.init_rows(out, rows[:m], keys[:m], int(a[5]), int(a[6]), int(a[7]),
                            float(a[8]), float(a[9]), float(a[10]), float(a[11]),
                            float(a[12]), seed)

    def run_pooled_forward(self, a):
        r = _ROW_ARGS
        if self._refused(self._t(a[r + 9])):  # zeros for every bag of the group
            out, feature_col, batch = self._t(a[r + 7]), self._t(a[r + 3]), int(a[r + 4])
            for col in feature_col.tolist():
                if col >= 0:
                    out[:batch, col:col + int(a[4])] = 0
            return
        tiers, transient, dim, row_ref = self._rows(a)
        self._cpu.pooled_forward(tiers, transient, row_ref, self._ids(a[r]), self._t(a[r + 1]),
                                 self._t(a[r + 2]), self._t(a[r + 3]), int(a[r + 4]), dim,
                                 bool(a[r + 6]), self._t(a[r + 7]))

    def run_sequence_forward(self, a):
        if self._refused(self._t(a[_ROW_ARGS + 3])):
            self._t(a[_ROW_ARGS + 2]).zero_()
            return
        tiers, transient, dim, row_ref = self._rows(a)
        self._cpu.sequence_forward(tiers, transient, row_ref, self._ids(a[_ROW_ARGS]), dim,
                                   self._t(a[_ROW_ARGS + 2]))

    def run_place_grads(self, a):
        # The backward's gradients are summed and applied by the CPU's fused backward
        # when demb_fused_update runs, from the arguments given here (a refused
        # batch places nothing, and its rows have no entry).
        refused = self._refused(self._t(a[13]))
        step = self._t(a[14])
        if step is not None and not refused:  # the optimizer's step count
            step += 1
        self._placed = None if refused else a

    def run_piece_counts(self, a):
        starts, num_unique, piece = self._t(a[0]), int(a[1]), int(a[2])
        entries = starts[1:num_unique + 1] - starts[:num_unique]
        pieces = torch.where(entries > piece, (entries + piece - 1) // piece, 0)
        if num_unique:
            self._t(a[3]).copy_(pieces)
        self._t(a[4])[0] = 0

    def run_piece_sums(self, a):
        pass  # the CPU's fused backward sums the hot rows (run_fused_update)

    def run_fused_update(self, a):
        p = self._placed
        if p is None:
            return
        rank, offsets = self._t(p[0]), self._t(p[3])
        device_rows, host_rows = self._t(a[0]), self._t(a[1])
        width, dim = int(a[2]), int(a[3])
        empty = torch.empty(0, width, dtype=torch.float32)
        starts = self._t(a[6])
        # rows with no entry are padding (the kernel skips them), all after the real ones
        num_unique = int((starts[1:int(a[5]) + 1] > starts[:int(a[5])]).sum())
        lr, step_size, bias2, decay = float(a[13]), float(a[20]), float(a[21]), float(a[22])
        if int(a[23]):  # schedule_step of optimizer_primitives.h, from device memory
            lr, t = float(self._t(a[23])[0]), int(self._t(a[24])[0])
            beta1, beta2, decoupled = float(a[25]), float(a[26]), float(a[27])
            step_size, bias2 = lr, 1.0
            if int(a[12]) == 1:  # Adam
                step_size = lr / (1.0 - beta1 ** t)
                bias2 = math.sqrt(1.0 - beta2 ** t)
            decay = 1.0 - lr * decoupled
        sums = torch.empty(num_unique, dim, dtype=torch.float32)
        self._cpu.sum_gradients(
            self._t(a[6])[:num_unique + 1], rank,
            offsets if offsets is not None else torch.empty(0, dtype=torch.int64),
            self._t(p[4]), self._t(p[5]), int(p[6]), bool(p[8]), self._t(a[9]), sums)
        self._cpu.update_rows(
            [device_rows if device_rows is not None else empty,
             host_rows if host_rows is not None else empty],
            self._t(a[4])[:num_unique], sums,
            # beta as 1 - the kernel's (1 - beta): the float32 1 - beta the kernel
            # multiplies by is what a float32 beta would lose 1e-5 of
            int(a[12]), lr, float(a[14]), 1.0 - float(a[18]), 1.0 - float(a[19]),
            float(a[17]), step_size, bias2, decay)

    def run_per_sample_weight_grad(self, a):
        r = _ROW_ARGS
        if self._refused(self._t(a[r + 8])) or self._t(a[r + 7]) is None:
            return  # refused, or bags without lookups: nothing to write
        tiers, transient, dim, row_ref = self._rows(a)
        self._cpu.per_sample_weight_grad(tiers, transient, row_ref, self._ids(a[r]),
                                         self._t(a[r + 1]), self._t(a[r + 2]), int(a[r + 3]),
                                         dim, self._t(a[r + 5]), self._t(a[r + 7]))


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


@contextlib.contextmanager
def emulated_cuda(kernels: Optional[EmulatedCudaKernels] = None):
    """Within: CPU tensors take the CUDA backend's path, kernels emulated on the CPU.

    Args:
        kernels: the emulation to use again (modules built under an earlier
            ``emulated_cuda`` keep its backend); default a new one.

    Yields:
        The ``EmulatedCudaKernels`` (its ``launches`` count every kernel launch).
    """
    kernels = EmulatedCudaKernels() if kernels is None else kernels
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
