"""The launches of ``csrc/cuda/cache.cu``: a step batch's promotion into a cache."""

import numpy as np
import torch

from dynamicemb.ops.cuda.launch import (KernelLauncher, _expect, _expect_batch,
                                        _host_readable, _i64, _ptr, _table_args)

__all__ = ["CacheKernels"]


class CacheKernels(KernelLauncher):
    """The cache promotion verbs of ``CudaKernels``."""

    def promotion_plan(self, meta, bc, keys, tids, counts, host_slots, one_table, cache_size):
        """(cache_slots, plan, rank, order) of a step batch's promotion; order: a stable
        sort by descending rank."""
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
        order = torch.sort(rank, descending=True, stable=True).indices
        return cache_slots, plan, rank, order

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
