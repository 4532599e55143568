"""The CUDA backend: the kernels of ``csrc/cuda`` compiled at run time by CuPy.

``CudaKernels`` offers the functions of the CPU extension (``csrc/cpu/verbs.h``) with
the same names, arguments and results, over CUDA tensors; ``CudaBackend`` is the
``Backend`` verbs over them (``dynamicemb.ops.kernels``), so the table, storage
and module code run unchanged on a GPU. Kernels are compiled once per process
and device by NVRTC (cached on disk by CuPy, keyed on the sources and headers)
and launched on PyTorch's current stream; tensors are passed as raw pointers
(no copies). Only ``dynamicemb.ops.for_device`` creates it.

Inserting passes sort the pass's keys by bucket and walk each bucket with one
warp, so results equal the CPU backend's (see ``csrc/cuda/hash_table.cu``).
"""

import hashlib
import os
import sys
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from dynamicemb.ops.interface import offsets_problem
from dynamicemb.ops.kernels import DeferredCount, KernelBackend

__all__ = ["CudaBackend", "CudaKernels", "cuda_source_root", "mapped_host_zeros"]

# Each kernel and the file of csrc/cuda that defines it.
_KERNELS = {
    **dict.fromkeys(("demb_hash_keys", "demb_buckets_of", "demb_find", "demb_upsert",
                     "demb_unpin", "demb_undo_upsert", "demb_grow", "demb_erase",
                     "demb_erase_where", "demb_expire"),
                    "hash_table.cu"),
    **dict.fromkeys(("demb_cache_probe", "demb_cache_rank", "demb_promotion_order",
                     "demb_promote_rows"), "cache.cu"),
    **dict.fromkeys(("demb_dedup_insert", "demb_dedup_first", "demb_dedup_number"), "dedup.cu"),
    **dict.fromkeys(("demb_check_offsets", "demb_init_rows", "demb_init_new_rows",
                     "demb_pooled_forward", "demb_sequence_forward",
                     "demb_place_grads", "demb_piece_counts", "demb_piece_sums",
                     "demb_fused_update",
                     "demb_per_sample_weight_grad"),
                    "embedding.cu"),
}
_BLOCK = 256
_WARPS_PER_BLOCK = _BLOCK // 32
# Dynamic shared memory a block may take without the opt-in attribute: the fused
# update keeps dim floats per warp there, so the widest row one warp can update.
_SHARED_LIMIT = 48 * 1024
MAX_DIM = _SHARED_LIMIT // 4
_NUM_OUTCOMES = 4
# Lookups of one row summed by one warp; hotter rows are split into pieces of
# this many, summed in parallel, then added in order (csrc/cuda/embedding.cu).
PIECE_ENTRIES = 128
# kMaxBucketWords * 64 in csrc/cuda/hash_table.cu: the inserting kernel keeps a
# bucket's bits in registers.
_MAX_BUCKET_CAPACITY = 1024


class _PinnedHostMemory:
    """Owns one ``cudaHostAlloc`` allocation; freed when the last tensor over it goes."""

    def __init__(self, runtime, nbytes: int) -> None:
        self._runtime = runtime
        # Portable: every device maps it; mapped: kernels may read it (implied by UVA).
        self.ptr = runtime.hostAlloc(max(nbytes, 1), runtime.hostAllocPortable
                                     | runtime.hostAllocMapped)

    def __del__(self) -> None:
        # at interpreter exit the CUDA context may be gone: the process frees it all
        if getattr(self, "ptr", 0) and not sys.is_finalizing():
            self._runtime.freeHost(self.ptr)
            self.ptr = 0


def mapped_host_zeros(shape: Tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """A zeroed tensor of ``shape`` in pinned host memory, as a tensor on ``device``
    (CUDA) whose pointer is the host memory's address in the unified address space.

    Raises:
        MemoryError: when the pinned memory cannot be had (the message gives the size).
    """
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - CudaKernels has already imported it
        raise ImportError(f"host memory for CUDA tables needs CuPy: {e}") from e
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        owner = _PinnedHostMemory(cupy.cuda.runtime, nbytes)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise MemoryError(f"could not allocate {nbytes} bytes of pinned host memory for a "
                          f"host store's rows ({e}); lower max_capacity or raise the "
                          f"device budget (local_hbm_for_values)") from e
    index = device.index if device.index is not None else torch.cuda.current_device()
    memory = cupy.cuda.UnownedMemory(owner.ptr, max(nbytes, 1), owner, device_id=index)
    array = cupy.ndarray((max(nbytes, 1),), dtype=cupy.uint8,
                         memptr=cupy.cuda.MemoryPointer(memory, 0))
    flat = torch.from_dlpack(array)[:nbytes]
    values = flat.view(dtype).view(shape)
    values.zero_()
    return values


def cuda_source_root() -> str:
    """The folder holding ``cuda/`` and ``dynamicemb/`` headers (the repo's ``csrc``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # A built package carries them as dynamicemb/csrc; a checkout has them at the root.
    for root in (os.path.join(package, "csrc"), os.path.join(os.path.dirname(package), "csrc")):
        if os.path.isdir(os.path.join(root, "cuda")):
            return root
    raise ImportError(f"dynamicemb's CUDA sources (csrc/cuda) were not found near {package}")


def kernel_program(root: str, digest: str, source: str) -> Tuple[str, Tuple[str, ...]]:
    """The code string and NVRTC options that ``CudaKernels`` hands CuPy for one file
    of ``csrc/cuda`` (CuPy adds the target architecture).

    Args:
        root: ``cuda_source_root()``.
        digest: ``_source_digest(root)``, carried in the code so that CuPy's disk
            cache sees a change to any header.
        source: a file name in ``root/cuda``.
    """
    with open(os.path.join(root, "cuda", source)) as f:
        code = f"// sources {digest}\n" + f.read()
    return code, ("-std=c++17", f"-I{root}")


def _source_digest(root: str) -> str:
    """Hash of every header and source: CuPy's disk cache keys on the code string
    only, not on files pulled in with ``-I``, so the code string carries this."""
    digest = hashlib.sha256()
    for folder in ("cuda", "dynamicemb"):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            with open(os.path.join(root, folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None or t.numel() == 0 else t.data_ptr())


def _i64(x) -> np.int64:
    return np.int64(int(x))


def _grid(threads: int, block: int = _BLOCK) -> Tuple[int]:
    return (max(1, (int(threads) + block - 1) // block),)


def _on_kernel_device(t: torch.Tensor) -> bool:
    """Whether the kernels can take ``t``'s pointer as device memory (the one test of
    a tensor's device here; the CPU emulation of ``dynamicemb_testing`` replaces it)."""
    return t.is_cuda


def _host_readable(t: torch.Tensor) -> bool:
    """Whether the kernels can read ``t`` in place: device memory or pinned host
    memory (through the unified address space)."""
    return _on_kernel_device(t) or t.is_pinned()


def _expect(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if not _on_kernel_device(t):
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _expect_batch(keys: torch.Tensor, tids: torch.Tensor) -> None:
    _expect(keys, torch.int64, "keys")
    _expect(tids, torch.int16, "table_ids")
    if keys.dim() != 1 or tids.shape != keys.shape:
        raise ValueError("keys and table_ids must be 1-D of one length")


def _warps_per_update_block(dim: int) -> int:
    """Warps per block of the fused update: as many as fit their dim-float
    accumulators in ``_SHARED_LIMIT`` bytes of shared memory, at most 8."""
    if not 1 <= dim <= MAX_DIM:
        raise ValueError(f"the CUDA backend updates rows of at most {MAX_DIM} floats "
                         f"(dim={dim})")
    return max(1, min(_WARPS_PER_BLOCK, _SHARED_LIMIT // (4 * int(dim))))


def _table_args(meta: Sequence[torch.Tensor], bc: int) -> list:
    """The DEMB_TABLE_PARAMS of csrc/cuda/common.cuh for meta =
    [keys, scores, tids, digests, occupied, pinned]."""
    if len(meta) != 6:
        raise ValueError(f"meta must hold 6 tensors, got {len(meta)}")
    keys, scores = meta[0], meta[1]
    if keys.stride(0) != 2 or scores.data_ptr() != keys.data_ptr() + 8:
        raise ValueError("keys and scores must be the two columns of one (capacity, 2) array")
    _expect(meta[2], torch.int16, "tids")
    _expect(meta[3], torch.uint8, "digests")
    _expect(meta[4], torch.int64, "occupied")
    _expect(meta[5], torch.int64, "pinned")
    num_buckets = keys.numel() // bc
    return [_ptr(keys), _ptr(meta[2]), _ptr(meta[3]), _ptr(meta[4]), _ptr(meta[5]),
            np.int64(num_buckets), np.int32(bc)]


def _row_args(tiers: Sequence[torch.Tensor], transient: torch.Tensor,
              row_ref: torch.Tensor, dim: int, init=None) -> list:
    """The DEMB_ROW_PARAMS of csrc/cuda/embedding.cu. A host tier must be pinned
    (or empty): the GPU reads its rows through the unified address space. ``init``
    (``InitRows``, or None): rows of negative references computed from the
    initializers instead of read from ``transient``."""
    if len(tiers) != 2:
        raise ValueError("tiers must be [device values, host values]")
    device, host = tiers
    _expect(device, torch.float32, "device values")
    if host.numel() and not _host_readable(host):
        raise ValueError("a host tier read by CUDA kernels must be in pinned memory")
    if host.numel() and host.size(1) != device.size(1):
        raise ValueError("both tiers must have one row width")
    if device.size(1) < dim:
        raise ValueError(f"value rows ({device.size(1)} wide) are narrower than dim {dim}")
    _expect(row_ref, torch.int64, "row_ref")
    computed = [_ptr(None)] * 4
    if init is not None:
        _expect_batch(init.keys, init.table_ids)
        _expect_init_spec(init.spec)
        if init.keys.numel() != row_ref.numel():
            raise ValueError("init keys must have one entry per row reference")
        computed = [_ptr(init.keys), _ptr(init.table_ids), _ptr(init.spec.ints),
                    _ptr(init.spec.floats)]
    return [_ptr(device), _ptr(host), np.int64(device.size(1)), _ptr(transient),
            np.int64(dim), _ptr(row_ref)] + computed


def _expect_init_spec(spec) -> None:
    _expect(spec.ints, torch.int64, "init ints")
    _expect(spec.floats, torch.float32, "init floats")
    if spec.ints.dim() != 2 or spec.ints.size(1) != 3 or spec.floats.shape != (
            spec.ints.size(0), 5):
        raise ValueError("an InitSpec holds (T, 3) ints and (T, 5) floats")


def _error_arg(error: Optional[torch.Tensor]) -> np.uint64:
    """The module's error word as a kernel's ``error`` pointer (null: none)."""
    if error is not None:
        _expect(error, torch.int64, "error")
        if error.numel() != 1:
            raise ValueError("the error word is one int64")
    return _ptr(error)


class _StreamHandle:
    """A raw CUDA stream in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.ptr)


class CudaKernels:
    """The CUDA implementation of the kernel functions of the CPU extension.

    Raises:
        ImportError: when CuPy is missing or cannot compile for this machine.
    """

    def __init__(self) -> None:
        try:
            import cupy  # noqa: PLC0415 (an optional dependency)
        except ImportError as err:
            raise ImportError(
                "dynamicemb's CUDA backend needs CuPy: pip install 'dynamicemb[cuda]' "
                "(or cupy-cuda12x / cupy-cuda13x matching your CUDA driver)") from err
        self._cupy = cupy
        self._root = cuda_source_root()
        self._digest = _source_digest(self._root)
        self._modules = {}  # (device index, source) -> cupy.RawModule
        self._functions = {}  # (device index, name) -> cupy.RawKernel
        self._streams = {}  # torch stream pointer -> cupy stream

    # ------------------------------------------------------------- launching
    def _module(self, device: int, source: str):
        key = (device, source)
        if key not in self._modules:
            code, options = kernel_program(self._root, self._digest, source)
            with self._cupy.cuda.Device(device):
                self._modules[key] = self._cupy.RawModule(code=code, options=options)
        return self._modules[key]

    def _function(self, device: int, name: str):
        key = (device, name)
        if key not in self._functions:
            module = self._module(device, _KERNELS[name])
            # CuPy compiles and loads a module at its first get_function, on the
            # current device: the table's, not whichever device is current.
            with self._cupy.cuda.Device(device):
                self._functions[key] = module.get_function(name)
        return self._functions[key]

    def _stream(self, device: torch.device):
        """CuPy's view of PyTorch's current stream on ``device`` (cached per stream)."""
        ptr = torch.cuda.current_stream(device).cuda_stream
        if ptr not in self._streams:
            cuda = self._cupy.cuda
            try:  # CuPy 14: the CUDA stream protocol
                self._streams[ptr] = cuda.Stream.from_external(_StreamHandle(ptr))
            except (AttributeError, TypeError):
                self._streams[ptr] = cuda.ExternalStream(ptr)
        return self._streams[ptr]

    def _launch(self, name: str, device: torch.device, threads: int, args: list,
                shared_mem: int = 0, block: int = _BLOCK) -> None:
        if threads <= 0:
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self._function(index, name)
        with self._cupy.cuda.Device(index), self._stream(device):
            kernel(_grid(threads, block), (block,), tuple(args), shared_mem=shared_mem)

    # ------------------------------------------------------------ hash table
    def hash_keys(self, keys: torch.Tensor, tids: torch.Tensor) -> torch.Tensor:
        _expect_batch(keys, tids)
        out = torch.empty_like(keys)
        self._launch("demb_hash_keys", keys.device, keys.numel(),
                     [_ptr(keys), _ptr(tids), _i64(keys.numel()), _ptr(out)])
        return out

    def find(self, meta, bc, keys, tids, single_table) -> torch.Tensor:
        _expect_batch(keys, tids)
        slots = torch.empty_like(keys)
        self._launch("demb_find", keys.device, keys.numel(),
                     _table_args(meta, bc) + [_ptr(keys), _ptr(tids), _i64(keys.numel()),
                                              np.bool_(single_table), _ptr(slots)])
        return slots

    def upsert(self, meta, bc, keys, tids, given, rule, now, evicts, can_grow, one_table,
               pending, slots, status, prev_scores, ev_keys, ev_tids, ev_scores,
               outcomes, buckets: Optional[torch.Tensor] = None,
               now_at: Optional[torch.Tensor] = None,
               size: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One inserting pass over keys[pending] (``pending=None``: every key, without
        building the positions; ``buckets``: their buckets, when the caller has
        them; ``now_at``: the time in device memory, instead of ``now``; ``size``:
        the table's size in device memory, which the pass advances); returns
        the deferred positions, or while the table may grow a ``DeferredCount``
        (their number stays on the device until the caller reads it with the
        outcomes)."""
        _expect_batch(keys, tids)
        if pending is not None:
            _expect(pending, torch.int64, "pending")
        _expect(outcomes, torch.int64, "outcomes")
        if outcomes.numel() != _NUM_OUTCOMES:
            raise ValueError(f"outcomes must hold {_NUM_OUTCOMES} counts")
        if rule != 0 and given is None:
            raise ValueError("the count and given-score rules need scores")
        if bc > _MAX_BUCKET_CAPACITY:
            raise ValueError(f"the CUDA backend inserts into buckets of at most "
                             f"{_MAX_BUCKET_CAPACITY} slots, got bucket_capacity={bc}")
        m = keys.numel() if pending is None else pending.numel()
        if m == 0:
            return torch.empty(0, dtype=torch.int64, device=keys.device)
        table = _table_args(meta, bc)
        if buckets is None:
            buckets = torch.empty(m, dtype=torch.int32, device=keys.device)
            self._launch("demb_buckets_of", keys.device, m, [
                _ptr(keys), _ptr(tids), _ptr(pending), _i64(m), table[5], _ptr(buckets)])
        elif pending is not None or buckets.shape != (m,) or buckets.dtype != torch.int32:
            raise ValueError("buckets are given for every key of a pass: (m,) int32, "
                             "pending=None")
        sorted_buckets, perm = torch.sort(buckets, stable=True)
        order = perm if pending is None else pending[perm]
        # The kernel adds to the caller's outcome counts (on the device: read once by
        # the caller), and counts deferred keys only while the table may grow (no
        # key is deferred otherwise).
        deferred = torch.zeros(1, dtype=torch.int64, device=keys.device) if can_grow else None
        self._launch("demb_upsert", keys.device, 32 * m, table + [
            _ptr(keys), _ptr(tids), _ptr(given), np.int32(rule), np.uint64(now),
            np.bool_(evicts), np.bool_(can_grow), np.bool_(one_table), _ptr(sorted_buckets),
            _ptr(order), _i64(m), _ptr(slots), _ptr(status), _ptr(prev_scores),
            _ptr(ev_keys), _ptr(ev_tids), _ptr(ev_scores), _ptr(outcomes), _ptr(deferred),
            _ptr(now_at), _ptr(size)])
        if deferred is None:
            return torch.empty(0, dtype=torch.int64, device=keys.device)
        # how many were deferred is read by the caller with the outcome counts
        return DeferredCount(deferred, pending,
                             status[:keys.numel()] if pending is None else status)

    def dedup_upsert(self, meta, bc, keys, tids, frequencies, now, evicts, can_grow,
                     one_table, slots, status, prev_scores, ev_keys, ev_tids, ev_scores,
                     outcomes):
        """``dedup`` (grouped) then a first clock-rule pass over the unique keys."""
        table = _table_args(meta, bc)
        unique, buckets = self._dedup(keys, tids, frequencies, True, num_buckets=int(table[5]))
        ukeys, utids, inverse, counts, starts, rank = unique
        deferred = self.upsert(meta, bc, ukeys, utids, None, 0, now, evicts, can_grow,
                               one_table, None, slots, status, prev_scores, ev_keys,
                               ev_tids, ev_scores, outcomes, buckets=buckets)
        return ukeys, utids, inverse, counts, starts, rank, deferred

    def padded_dedup_upsert(self, meta, bc, keys, tids, frequencies, rule, time, now_index,
                            evicts, one_table, error, outcomes, size, part=None):
        """``dedup`` (grouped) padded to the n keys, then one inserting pass over them
        into a table that cannot grow (so no key is deferred): nothing is read on
        the host. The numbering kernel advances ``time`` (the table's clock and
        step, (2,) int64) unless the batch is refused, and the pass reads its time
        from ``time[now_index]``; ``rule`` 0 scores by it, a count rule by the
        dedup's counts. The pass adds its outcome counts to ``outcomes`` (4,) and its
        inserts into empty slots to ``size`` (1,).

        Returns:
            (ukeys, utids, inverse, counts, starts, rank, slots, status, prev_scores,
            ev_keys, ev_tids, ev_scores): the per-key arrays have n entries; padding
            gets slot -1 and status FAILED and is counted nowhere.
        """
        table = _table_args(meta, bc)
        _expect(time, torch.int64, "time")
        _expect(outcomes, torch.int64, "outcomes")
        if time.numel() != 2 or now_index not in (0, 1):
            raise ValueError("time holds a clock and a step; now_index picks one")
        n = keys.numel()
        unique, buckets = self._dedup(keys, tids, frequencies, True, num_buckets=int(table[5]),
                                      padded=True, error=error, time=time, part=part)
        ukeys, utids, inverse, counts, starts, rank = unique
        outs = [torch.empty(n, dtype=dtype, device=keys.device) for dtype in (
            torch.int64, torch.int8, torch.int64, torch.int64, torch.int16, torch.int64)]
        given = None if rule == 0 else counts
        self.upsert(meta, bc, ukeys, utids, given, rule, 0, evicts, False, one_table, None,
                    *outs, outcomes, buckets=buckets, now_at=time[now_index:now_index + 1],
                    size=size)
        return (ukeys, utids, inverse, counts, starts, rank, *outs)

    def padded_upsert(self, meta, bc, keys, tids, scores, rule, evicts, one_table, buckets,
                      outcomes, size):
        """One inserting pass over unique keys with their buckets given (kNoBucket:
        skipped, slot -1, FAILED, counted nowhere) into a table that cannot grow;
        ``outcomes`` (4,) and ``size`` (1,) advance on the device. Returns (slots,
        status, prev_scores, ev_keys, ev_tids, ev_scores), (n,) each."""
        _expect(buckets, torch.int32, "buckets")
        _expect(outcomes, torch.int64, "outcomes")
        n = keys.numel()
        outs = [torch.empty(n, dtype=dtype, device=keys.device) for dtype in (
            torch.int64, torch.int8, torch.int64, torch.int64, torch.int16, torch.int64)]
        self.upsert(meta, bc, keys, tids, scores, rule, 0, evicts, False, one_table, None,
                    *outs, outcomes, buckets=buckets, size=size)
        return tuple(outs)

    def erase_where(self, meta, bc, keys, tids, status, which, erased, size) -> None:
        """Erases keys[i] where status[i] == which; erased (1,) += and size (1,) -= the
        keys found."""
        _expect_batch(keys, tids)
        _expect(status, torch.int8, "status")
        _expect(erased, torch.int64, "erased")
        _expect(size, torch.int64, "size")
        self._launch("demb_erase_where", keys.device, keys.numel(), _table_args(meta, bc) + [
            _ptr(keys), _ptr(tids), _ptr(status), np.int32(which), _i64(keys.numel()),
            _ptr(erased), _ptr(size)])

    def promotion_plan(self, meta, bc, keys, tids, counts, host_slots, one_table, cache_size):
        """(cache_slots, plan, rank) of a padded batch's promotion (csrc/cuda/cache.cu)."""
        _expect_batch(keys, tids)
        _expect(counts, torch.int64, "counts")
        _expect(host_slots, torch.int64, "host_slots")
        _expect(cache_size, torch.int64, "cache_size")
        n = keys.numel()
        dev = keys.device
        table = _table_args(meta, bc)
        cache_slots = torch.empty(n, dtype=torch.int64, device=dev)
        plan = torch.zeros(4, dtype=torch.int64, device=dev)
        rank = torch.empty(n, dtype=torch.int64, device=dev)
        self._launch("demb_cache_probe", dev, n, table + [
            _ptr(keys), _ptr(tids), _ptr(counts), _ptr(host_slots), _i64(n),
            np.bool_(one_table), _ptr(cache_slots), _ptr(plan)])
        capacity = int(table[5]) * bc
        self._launch("demb_cache_rank", dev, max(n, 1), [
            _ptr(counts), _ptr(host_slots), _ptr(cache_slots), _i64(n), _i64(capacity),
            _ptr(cache_size), _ptr(plan), _ptr(rank)])
        return cache_slots, plan, rank

    def promotion_order(self, order, keys, tids, host_slots, host_keys, plan, num_buckets):
        """The cache call's (keys, tids, scores, buckets) in ``order``."""
        _expect(order, torch.int64, "order")
        if host_keys.stride(0) != 2:
            raise ValueError("host_keys must be the keys column of a (slots, 2) array")
        n = order.numel()
        dev = order.device
        out_keys = torch.empty(n, dtype=torch.int64, device=dev)
        out_tids = torch.empty(n, dtype=torch.int16, device=dev)
        out_scores = torch.empty(n, dtype=torch.int64, device=dev)
        buckets = torch.empty(n, dtype=torch.int32, device=dev)
        self._launch("demb_promotion_order", dev, n, [
            _ptr(order), _ptr(keys), _ptr(tids), _ptr(host_slots), _ptr(host_keys), _i64(n),
            _ptr(plan), _i64(num_buckets), _ptr(out_keys), _ptr(out_tids), _ptr(out_scores),
            _ptr(buckets)])
        return out_keys, out_tids, out_scores, buckets

    def promote_rows(self, host_meta, host_bc, host_values, cache_values, order, host_slots,
                     slots, status, ev_keys, ev_tids, refs) -> None:
        """Victims written back, new keys' rows copied in, refs (n,) written."""
        _expect(refs, torch.int64, "refs")
        if host_values.shape[1] != cache_values.shape[1]:
            raise ValueError("the host store's and the cache's rows must have one width")
        if host_values.numel() and not _host_readable(host_values):
            raise ValueError("a host tier read by CUDA kernels must be in pinned memory")
        n = order.numel()
        self._launch("demb_promote_rows", refs.device, 32 * n, _table_args(host_meta, host_bc) + [
            _ptr(host_values), _ptr(cache_values), np.int64(cache_values.shape[1]), _ptr(order),
            _ptr(host_slots), _ptr(slots), _ptr(status), _ptr(ev_keys), _ptr(ev_tids),
            _i64(n), _ptr(refs)])

    def unpin(self, meta, bc, slots) -> None:
        _expect(slots, torch.int64, "slots")
        self._launch("demb_unpin", slots.device, slots.numel(),
                     _table_args(meta, bc) + [_ptr(slots), _i64(slots.numel())])

    def undo_upsert(self, meta, bc, slots, status, prev_scores, ev_keys, ev_tids,
                    ev_scores) -> None:
        """Reverts an inserting call, all slots at once: each slot by the oldest key
        that touched it (a stable sort by slot finds it), whose record holds the
        slot as it was before the call."""
        _expect(slots, torch.int64, "slots")
        by_slot, order = torch.sort(slots, stable=True)
        oldest = torch.ones_like(by_slot, dtype=torch.bool)
        torch.ne(by_slot[1:], by_slot[:-1], out=oldest[1:])
        keep = torch.empty_like(oldest)
        keep[order] = oldest
        self._launch("demb_undo_upsert", slots.device, slots.numel(), _table_args(meta, bc) + [
            _ptr(torch.where(keep, slots, -1)), _ptr(status), _ptr(prev_scores), _ptr(ev_keys),
            _ptr(ev_tids), _ptr(ev_scores), _i64(slots.numel())])

    def grow(self, old_meta, new_meta, bc) -> torch.Tensor:
        old = _table_args(old_meta, bc)
        new = _table_args(new_meta, bc)
        if new[5] != 2 * old[5]:
            raise ValueError("grow doubles the bucket count")
        moved = torch.empty(old_meta[0].numel(), dtype=torch.int64, device=old_meta[0].device)
        self._launch("demb_grow", moved.device, moved.numel(), old + new[:5] + [_ptr(moved)])
        return moved

    def erase(self, meta, bc, keys, tids) -> torch.Tensor:
        """Erases each key once: a key given twice is erased by its first occurrence."""
        _expect_batch(keys, tids)
        _, is_first, _ = self._first_positions(keys, tids)
        positions = is_first.nonzero().squeeze(1)
        ukeys, utids = keys[positions], tids[positions]
        erased_unique = torch.empty(ukeys.numel(), dtype=torch.bool, device=keys.device)
        self._launch("demb_erase", keys.device, ukeys.numel(), _table_args(meta, bc) + [
            _ptr(ukeys), _ptr(utids), _i64(ukeys.numel()), _ptr(erased_unique)])
        erased = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        erased[positions] = erased_unique
        return erased

    def expire(self, meta, bc, time_mask, before) -> torch.Tensor:
        """TTL sweep: empties slots last accessed before ``before``; (capacity,) bool."""
        if before < 0:
            raise ValueError(f"before must be >= 0, got {before}")
        expired = torch.empty(meta[2].numel(), dtype=torch.bool, device=meta[2].device)
        self._launch("demb_expire", expired.device, expired.numel(), _table_args(meta, bc) + [
            np.uint64(time_mask & 0xFFFFFFFFFFFFFFFF), np.uint64(before), _ptr(expired)])
        return expired

    def occupied_slots(self, meta, bc, start, end) -> torch.Tensor:
        """Occupied slots of [start, end), ascending (digest 0 marks an empty slot)."""
        return (meta[3][start:end] != 0).nonzero().squeeze(1) + start

    # ------------------------------------------------------------------ dedup
    def _first_positions(self, keys: torch.Tensor, tids: torch.Tensor, zeros: int = 0,
                         part=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n,) int64 each: the first position of each position's (table id, key)
        pair, and whether the position is that first one (1 or 0); and ``zeros``
        int64 zeros for the caller, from the set's own fill (one launch for both).
        ``part`` (``BatchPart``, or None): positions of other groups are left out
        (first -1)."""
        n = keys.numel()
        if n >= 2 ** 31:
            raise ValueError(f"dedup takes fewer than 2^31 keys, got {n}")
        size = 16
        while size < 2 * n:
            size <<= 1
        # the set's entries (int32, 0: empty) and the caller's zeros
        zeroed = torch.zeros(size // 2 + zeros, dtype=torch.int64, device=keys.device)
        table = zeroed[:size // 2].view(torch.int32)
        where = torch.empty(n, dtype=torch.int64, device=keys.device)
        first = torch.empty(n, dtype=torch.int64, device=keys.device)
        is_first = torch.empty(n, dtype=torch.int64, device=keys.device)
        self._launch("demb_dedup_insert", keys.device, n,
                     [_ptr(keys), _ptr(tids), _i64(n), _ptr(table), _i64(size - 1), _ptr(where),
                      _ptr(None if part is None else part.groups),
                      _i64(0 if part is None else part.group)])
        self._launch("demb_dedup_first", keys.device, n,
                     [_ptr(table), _ptr(where), _i64(n), _ptr(first), _ptr(is_first)])
        return first, is_first, zeroed[size // 2:]

    def dedup(self, keys, tids, frequencies, group=False):
        """Unique pairs in first-occurrence order: (keys, tids, inverse, counts,
        starts, rank); starts and rank are empty unless ``group``."""
        return self._dedup(keys, tids, frequencies, group)[0]

    def padded_dedup(self, keys, tids, error, part=None):
        """``dedup`` (not grouped) padded to the n keys: nothing read on the host."""
        return self._dedup(keys, tids, None, False, padded=True, error=error, part=part)[0]

    def _dedup(self, keys, tids, frequencies, grouped: bool, num_buckets: Optional[int] = None,
               padded: bool = False, error: Optional[torch.Tensor] = None,
               time: Optional[torch.Tensor] = None, part=None):
        """``dedup``'s tuple, and with ``num_buckets`` each unique pair's bucket in a
        table of that many buckets ((U,) int32, written by the numbering kernel:
        an inserting pass needs no launch of its own to find them), else None.

        ``padded``: the unique arrays have N entries (padding past the unique
        count, which is not read: no sync); ``error``: the module's error word (a
        refused batch has no unique pair); ``time``: counters the numbering kernel
        advances by one unless the batch is refused (an empty batch too); ``part``
        (``BatchPart``): the keys of other groups are left out (inverse -1)."""
        _expect_batch(keys, tids)
        n = keys.numel()
        dev = keys.device
        # zeros for the occurrences (U,), counted by atomics, and the grouping's
        # starts (U + 1,) whose first entry is 0, U <= n
        first, is_first, zeroed = self._first_positions(keys, tids,
                                                        zeros=2 * n + 1 if grouped else n,
                                                        part=part)
        number = torch.cumsum(is_first, 0)  # pair first seen at i: number[i] - 1
        if padded:  # the unique count is at most n
            u = n
        else:
            u = int(number[-1]) if n else 0  # the dedup's one sync: the unique count
        ukeys = torch.empty(u, dtype=torch.int64, device=dev)
        utids = torch.empty(u, dtype=tids.dtype, device=dev)
        inverse = torch.empty(n, dtype=torch.int64, device=dev)
        occurrences = zeroed[:u]
        buckets = (None if num_buckets is None
                   else torch.empty(u, dtype=torch.int32, device=dev))
        self._launch("demb_dedup_number", dev, n if time is None else max(n, 1), [
            _ptr(keys), _ptr(tids), _ptr(first), _ptr(number), _i64(n), _ptr(ukeys),
            _ptr(utids), _ptr(inverse), _ptr(occurrences), _i64(num_buckets or 0),
            _ptr(buckets), np.bool_(padded), _error_arg(error), _ptr(time)])
        counts = occurrences
        left_out = error is not None or part is not None  # some inverse may be -1
        if frequencies is not None:
            # a refused batch's inverse is -1, and another group's key's: their
            # frequencies go to an entry past the pairs
            at = torch.where(inverse >= 0, inverse, u) if left_out else inverse
            counts = torch.zeros(u + 1, dtype=torch.int64, device=dev).index_add_(
                0, at, frequencies)[:u]
        if not grouped:
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return (ukeys, utids, inverse, counts, empty, empty), buckets
        # another group's keys must rank after the group's (a refused batch's may rank
        # anywhere: it has no row to update)
        starts, rank = self._group_by_unique(inverse, occurrences, zeroed[u:2 * u + 1],
                                             part is not None)
        return (ukeys, utids, inverse, counts, starts, rank), buckets

    @staticmethod
    def _group_by_unique(inverse: torch.Tensor, occurrences: torch.Tensor,
                         starts: torch.Tensor,
                         left_out: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """The stable counting sort of ``inverse`` given each unique index's
        occurrences (U,): starts (U + 1,; given with its first entry 0, filled
        here), rank (N,). ``left_out``: keys with inverse -1 (another group's) rank
        -1, after every key of the group in the sort."""
        n = inverse.numel()
        torch.cumsum(occurrences, 0, out=starts[1:])
        key = torch.where(inverse >= 0, inverse, n) if left_out else inverse
        order = torch.sort(key, stable=True).indices
        rank = torch.empty(n, dtype=torch.int64, device=inverse.device)
        rank[order] = torch.arange(n, device=inverse.device)
        if left_out:  # another group's lookups place no gradient (rank -1)
            rank = torch.where(inverse >= 0, rank, -1)
        return starts, rank

    # -------------------------------------------------------------- embedding
    def check_offsets(self, offsets: torch.Tensor, num_indices: int,
                      error: Optional[torch.Tensor] = None) -> Optional[int]:
        """0, or the first problem: 1 first entry not 0, 2 last not num_indices,
        3 decreasing. With ``error`` (the module's word): recorded there, not read
        (None is returned)."""
        if offsets.dtype != torch.int64:
            raise TypeError(f"offsets has dtype {offsets.dtype}, expected torch.int64")
        if offsets.numel() < 1:
            raise ValueError("offsets must have at least one entry")
        _expect(offsets, torch.int64, "offsets")
        word = torch.zeros(1, dtype=torch.int64, device=offsets.device) if error is None else error
        self._launch("demb_check_offsets", offsets.device, offsets.numel(), [
            _ptr(offsets), _i64(offsets.numel() - 1), _i64(num_indices), _error_arg(word)])
        if error is not None:
            return None
        return offsets_problem(int(word))  # a bad batch raises before any change: a sync

    def init_rows(self, out, rows, keys, table, dim, mode, mean, std_dev, lower, upper,
                  value, seed) -> None:
        _expect(out, torch.float32, "out")
        _expect(rows, torch.int64, "rows")
        _expect(keys, torch.int64, "keys")
        if out.dim() != 2 or out.size(1) < dim:
            raise ValueError("out must be [R, >= dim]")
        m = rows.numel()
        self._launch("demb_init_rows", out.device, m * dim, [
            _ptr(out), np.int64(out.size(1)), _ptr(rows), _ptr(keys), _i64(m), _i64(table),
            _i64(dim), np.int32(mode), np.float32(mean), np.float32(std_dev),
            np.float32(lower), np.float32(upper), np.float32(value),
            np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF)])

    def init_new_rows(self, values, slots, status, keys, tids, dim, spec,
                      state_value) -> None:
        """The full initial rows of the keys whose status is INSERTED or
        EVICTED_AND_INSERTED (one thread per element; no count needed)."""
        _expect(values, torch.float32, "values")
        _expect(slots, torch.int64, "slots")
        _expect(status, torch.int8, "status")
        _expect_batch(keys, tids)
        _expect_init_spec(spec)
        n = slots.numel()
        if status.numel() != n or keys.numel() != n or values.dim() != 2:
            raise ValueError("slots, status and keys need one length; values [C, width]")
        width = values.size(1)
        self._launch("demb_init_new_rows", values.device, n * width, [
            _ptr(values), np.int64(width), _ptr(slots), _ptr(status), _ptr(keys), _ptr(tids),
            _i64(n), _i64(dim), _ptr(spec.ints), _ptr(spec.floats), np.float32(state_value)])

    def pooled_forward(self, tiers, transient, row_slot, inverse, offsets, weights,
                       feature_col, batch, dim, mean, out, init=None, error=None) -> None:
        rows = _row_args(tiers, transient, row_slot, dim, init)
        num_bags = offsets.numel() - 1
        if num_bags != feature_col.numel() * batch:
            raise ValueError("offsets must have num_features * batch + 1 entries")
        self._launch("demb_pooled_forward", out.device, 32 * num_bags, rows + [
            _ptr(inverse), _ptr(offsets), _ptr(weights), _ptr(feature_col), _i64(batch),
            _i64(num_bags), np.bool_(mean), _ptr(out), np.int64(out.size(1)),
            _error_arg(error)])

    def sequence_forward(self, tiers, transient, row_slot, inverse, dim, out, init=None,
                         error=None) -> None:
        rows = _row_args(tiers, transient, row_slot, dim, init)
        n = inverse.numel()
        self._launch("demb_sequence_forward", out.device, n * dim,
                     rows + [_ptr(inverse), _i64(n), _ptr(out), _error_arg(error)])

    def fused_backward(self, tiers, row_slot, starts, rank, offsets, weights, feature_col,
                       batch, dim, mean, grad, kind, lr, eps, beta1, beta2, weight_decay,
                       step_size, bias_correction2_sqrt, decay_scale, error=None,
                       schedule=None) -> None:
        _expect(grad, torch.float32, "grad")
        _expect(starts, torch.int64, "starts")
        _expect(rank, torch.int64, "rank")
        device_rows, host_rows = tiers
        _row_args(tiers, device_rows[:0], row_slot, dim)  # checks only
        num_unique = row_slot.numel()
        if starts.numel() != num_unique + 1:
            raise ValueError("starts must have one entry per unique row + 1")
        pooled = offsets.numel() > 0
        n = rank.numel()
        # starts[-1] (the group's lookups) is at most n, the batch's lookups: the
        # per-entry arrays are sized by that bound rather than read (a sync).
        entries = n
        dev = grad.device
        # every entry the update reads (below starts[-1]) is placed: no zeroing
        pos = torch.empty(entries, dtype=torch.int64, device=dev)
        scale = torch.empty(entries, dtype=torch.float32, device=dev)
        num_bags = offsets.numel() - 1 if pooled else 0
        advance = schedule is not None and schedule.advance
        if schedule is not None:
            _expect(schedule.lr, torch.float64, "lr")
            _expect(schedule.step, torch.int64, "step")
        # the launch that advances the step count has a thread even for no bag
        threads = num_bags if pooled else n
        self._launch("demb_place_grads", dev, max(threads, 1) if advance else threads, [
            _ptr(rank), _i64(n), _i64(entries), _ptr(offsets if pooled else None),
            _ptr(weights), _ptr(feature_col), _i64(batch), _i64(num_bags), np.bool_(mean),
            np.int64(grad.size(1)), _ptr(pos), _ptr(scale), _ptr(None), _error_arg(error),
            _ptr(schedule.step if advance else None)])
        # No counter of ranks outside [0, entries) (the kernel skips them): the
        # group's own dedup makes rank, an internal invariant; reading a count back
        # would be a sync, and zeroing one a launch.
        first_piece, partial = self._piece_sums(starts, pos, scale, grad, dim, entries)
        warps = _warps_per_update_block(dim)
        self._launch("demb_fused_update", dev, 32 * num_unique, [
            _ptr(device_rows), _ptr(host_rows), np.int64(device_rows.size(1)), _i64(dim),
            _ptr(row_slot), _i64(num_unique), _ptr(starts), _ptr(pos), _ptr(scale),
            _ptr(grad), _ptr(first_piece), _ptr(partial), np.int32(kind), np.float32(lr), np.float32(eps), np.float32(beta1),
            np.float32(beta2), np.float32(weight_decay), np.float32(1.0 - beta1),
            np.float32(1.0 - beta2), np.float32(step_size),
            np.float32(bias_correction2_sqrt), np.float32(decay_scale),
            _ptr(None if schedule is None else schedule.lr),
            _ptr(None if schedule is None else schedule.step),
            np.float64(beta1 if schedule is None else schedule.beta1),
            np.float64(beta2 if schedule is None else schedule.beta2),
            np.float64(0.0 if schedule is None else schedule.decoupled_decay)],
            shared_mem=warps * int(dim) * 4, block=32 * warps)

    def _piece_sums(self, starts, pos, scale, grad, dim, entries: int):
        """Partial sums of the hot rows' pieces: (first_piece (U + 1,), partial
        (pieces bound, dim)), or (None, None) when no row can be hot.

        The number of pieces is not read on the host (a sync): a hot row has L >
        PIECE_ENTRIES entries and ceil(L / PIECE_ENTRIES) < 2 L / PIECE_ENTRIES
        pieces, so there are fewer than 2 entries / PIECE_ENTRIES in all. The
        kernel grids over that bound and finds each piece's row itself.
        """
        bound = 2 * entries // PIECE_ENTRIES
        if bound == 0:
            return None, None
        num_unique = starts.numel() - 1
        pieces = torch.empty(num_unique, dtype=torch.int64, device=grad.device)
        first_piece = torch.empty_like(starts)
        self._launch("demb_piece_counts", grad.device, max(num_unique, 1), [
            _ptr(starts), _i64(num_unique), _i64(PIECE_ENTRIES), _ptr(pieces),
            _ptr(first_piece)])
        torch.cumsum(pieces, 0, out=first_piece[1:])
        partial = torch.empty(bound, int(dim), dtype=torch.float32, device=grad.device)
        self._launch("demb_piece_sums", grad.device, 32 * bound, [
            _ptr(starts), _ptr(first_piece), _i64(num_unique), _i64(PIECE_ENTRIES),
            _i64(bound), _ptr(pos), _ptr(scale), _ptr(grad), _i64(dim), _ptr(partial)])
        return first_piece, partial

    def per_sample_weight_grad(self, tiers, transient, row_slot, inverse, offsets,
                               feature_col, batch, dim, grad, out, init=None,
                               error=None) -> None:
        rows = _row_args(tiers, transient, row_slot, dim, init)
        num_bags = offsets.numel() - 1
        self._launch("demb_per_sample_weight_grad", out.device, 32 * num_bags, rows + [
            _ptr(inverse), _ptr(offsets), _ptr(feature_col), _i64(batch), _i64(num_bags),
            _ptr(grad), np.int64(grad.size(1)), _ptr(out), _error_arg(error)])


class CudaBackend(KernelBackend):
    """Kernels over CUDA tensors.

    Raises:
        ImportError: when CuPy is missing (the message says what to install).
    """

    #: The widest embedding a group may have (the fused update's shared memory).
    max_dim = MAX_DIM
    free_host_reads = False
    counts_on_device = True

    def __init__(self) -> None:
        super().__init__(CudaKernels())

    def zeros(self, shape, dtype, device):
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    def host_zeros(self, shape, dtype, device):
        """Zeroed pinned host memory mapped into the GPU's address space (UVA), seen
        as a CUDA tensor: kernels and torch ops read and write it in place over
        the bus, and it counts against host memory, not the GPU's."""
        return mapped_host_zeros(tuple(shape), dtype, device)
