"""``KernelBackend``: the ``Backend`` verbs over one device's compiled kernel functions."""

from typing import Any

import torch

from dynamicemb.ops.interface import (
    Backend,
    Deduplicated,
    OptimizerUpdate,
    PromotionPlan,
    Upserted,
    optimizer_code,
)

__all__ = ["GROW_CHUNK_BYTES", "KernelBackend"]

#: The most value bytes growth gathers at once (its temporary beyond the two tables).
GROW_CHUNK_BYTES = 64 << 20

_NO_ARGUMENTS: dict = {}  # never written


class KernelBackend(Backend):
    """The verbs over ``kernels`` (the CPU extension module or ``CudaKernels``)."""

    def __init__(self, kernels: Any) -> None:
        self.kernels = kernels

    # ------------------------------------------------------------ hash table
    def hash_keys(self, *, keys, table_ids):
        return self.kernels.hash_keys(keys, table_ids)

    def find(self, *, memory, keys, table_ids, one_table):
        return self.kernels.find(memory.meta, memory.bucket_capacity, keys, table_ids, one_table)

    def upsert(self, *, memory, keys, table_ids, scores, rule, evicts, one_table, outcomes,
               size, buckets=None, time=None, now_index=0, ttl=0):
        return Upserted(*self.kernels.upsert(
            memory.meta, memory.bucket_capacity, keys, table_ids, scores, int(rule), evicts,
            one_table, buckets, outcomes, size, time=time, now_index=now_index, ttl=int(ttl)))

    def dedup_upsert(self, *, memory, keys, table_ids, frequencies, rule, time, now_index,
                     evicts, one_table, error, outcomes, size, part=None, table_scores=None,
                     ttl=0):
        *unique, slots, status, prev, ev_keys, ev_tids, ev_scores = self.kernels.dedup_upsert(
            memory.meta, memory.bucket_capacity, keys, table_ids, frequencies, int(rule), time,
            now_index, evicts, one_table, error, outcomes, size, part, table_scores, int(ttl))
        return Deduplicated(*unique), Upserted(slots, status, prev, ev_keys, ev_tids, ev_scores)

    def dedup(self, *, keys, table_ids, error, part=None, frequencies=None, group=False,
              time=None):
        unique = Deduplicated(*self.kernels.dedup(
            keys, table_ids, error, part, frequencies=frequencies, group=group, time=time))
        return unique if group else unique._replace(starts=None, rank=None)

    def erase_where(self, *, memory, keys, table_ids, status, which, erased, size):
        self.kernels.erase_where(memory.meta, memory.bucket_capacity, keys, table_ids, status,
                                 which, erased, size)

    def promotion_plan(self, *, cache, keys, table_ids, counts, host_slots, one_table,
                       cache_size):
        return PromotionPlan(*self.kernels.promotion_plan(
            cache.meta, cache.bucket_capacity, keys, table_ids, counts, host_slots, one_table,
            cache_size))

    def promotion_order(self, *, order, keys, table_ids, host_slots, host, plan, cache):
        return self.kernels.promotion_order(order, keys, table_ids, host_slots, host.meta[0],
                                            plan.plan, cache.num_buckets)

    def promote_rows(self, *, host, cache, order, host_slots, cached, refs):
        self.kernels.promote_rows(host.meta, host.bucket_capacity, host.values, cache.values,
                                  order, host_slots, cached.slots, cached.status,
                                  cached.ev_keys, cached.ev_tids, refs)

    def init_rows(self, *, values, slots, status, keys, table_ids, dim, spec, format,
                  state_value=0.0):
        self.kernels.init_rows(values, slots, status, keys, table_ids, dim, spec, state_value,
                               **self._formatted(format))

    def undo_upsert(self, *, memory, upserted):
        self.kernels.undo_upsert(memory.meta, memory.bucket_capacity, upserted.slots,
                                 upserted.status, upserted.prev_scores, upserted.ev_keys,
                                 upserted.ev_tids, upserted.ev_scores)

    def grow(self, *, memory):
        """Doubles the table. Peak memory: both tables, 8 bytes per old slot and one chunk of
        rows (at most ``GROW_CHUNK_BYTES``). Out of memory leaves ``memory`` as it was."""
        new = self.new_table(num_buckets=2 * memory.num_buckets,
                             max_num_buckets=memory.max_num_buckets,
                             bucket_capacity=memory.bucket_capacity,
                             value_dim=memory.values.shape[1], value_dtype=memory.values.dtype,
                             device=memory.values.device,
                             values_in_host_memory=memory.values_in_host_memory)
        moved = self.kernels.grow(memory.meta, new.meta, memory.bucket_capacity)
        row_bytes = max(1, memory.values.shape[1] * memory.values.element_size())
        chunk = max(1, GROW_CHUNK_BYTES // row_bytes)
        for start in range(0, moved.numel(), chunk):  # rows move a chunk at a time
            part = moved[start:start + chunk]
            occupied = (part >= 0).nonzero().squeeze(1)  # growth is rare: a sync is fine
            new.values[part[occupied]] = memory.values[start:start + chunk][occupied]
        self._retire([*memory.meta, memory.values])  # the copies above still read them
        memory.meta, memory.values, memory.num_buckets = new.meta, new.values, new.num_buckets

    def _retire(self, tensors) -> None:
        """Arrays that kernels may still read (CUDA keeps them until the stream's work is done)."""

    def erase(self, *, memory, keys, table_ids):
        return self.kernels.erase(memory.meta, memory.bucket_capacity, keys, table_ids)

    def expire(self, *, memory, time_mask, before):
        return self.kernels.expire(memory.meta, memory.bucket_capacity, time_mask, before)

    def occupied_slots(self, *, memory, start, end):
        return self.kernels.occupied_slots(memory.meta, memory.bucket_capacity, start, end)

    # ------------------------------------------------------------- embedding
    def check_offsets(self, *, offsets, num_indices, error=None):
        return self.kernels.check_offsets(offsets, num_indices, **self._counted(error=error))

    def _formatted(self, format, rounding=None) -> dict:
        """The keywords of stored rows of ``format`` (float32: none)."""
        if format.dtype == torch.float32:
            return _NO_ARGUMENTS
        if format.dtype not in self.row_dtypes:
            raise ValueError(f"{type(self).__name__} has no kernels for {format.dtype} rows "
                             f"(it reads {[str(d) for d in self.row_dtypes]})")
        found = {"row_format": (format.code, format.state_offset)}
        if rounding is not None:
            found["rounding"] = tuple(rounding)
        return found

    def _counted(self, init=None, error=None, schedule=None) -> dict:
        """The given keyword arguments of a step counted on the device."""
        if init is None and error is None and schedule is None:
            return _NO_ARGUMENTS  # the common case, first: this runs on every launch
        return {name: value for name, value in (("init", init), ("error", error),
                                                ("schedule", schedule)) if value is not None}

    def pooled_forward(self, *, sources, row_ref, inverse, offsets, weights, feature_col,
                       batch, dim, mean, out, error=None):
        self.kernels.pooled_forward([sources.device, sources.host], sources.transient, row_ref,
                                    inverse, offsets, weights, feature_col, batch, dim, mean, out,
                                    **self._counted(init=sources.init, error=error),
                                    **self._formatted(sources.format))

    def sequence_forward(self, *, sources, row_ref, inverse, dim, out, error=None):
        self.kernels.sequence_forward([sources.device, sources.host], sources.transient,
                                      row_ref, inverse, dim, out,
                                      **self._counted(init=sources.init, error=error),
                                      **self._formatted(sources.format))

    def fused_backward(self, *, sources, row_ref, starts, rank, offsets, weights, feature_col,
                       batch, dim, mean, grad, update: OptimizerUpdate, error=None,
                       schedule=None, sums=None, rounding=None):
        if sums is not None:
            raise ValueError(f"{type(self).__name__} sums gradients in its update kernel")
        formatted = self._formatted(sources.format, rounding)
        no_offsets = torch.empty(0, dtype=torch.int64, device=grad.device)
        self.kernels.fused_backward(
            [sources.device, sources.host], row_ref, starts, rank,
            no_offsets if offsets is None else offsets, weights, feature_col, batch, dim, mean,
            grad, optimizer_code(update.optimizer), update.lr, update.eps, update.beta1,
            update.beta2, update.weight_decay, update.step_size, update.bias_correction2_sqrt,
            update.decay_scale, **self._counted(error=error, schedule=schedule), **formatted)
        return 0  # values unchecked: a count would wait for the device

    def per_sample_weight_grad(self, *, sources, row_ref, inverse, offsets, feature_col,
                               batch, dim, grad, out, error=None):
        self.kernels.per_sample_weight_grad([sources.device, sources.host], sources.transient,
                                            row_ref, inverse, offsets, feature_col, batch, dim,
                                            grad, out,
                                            **self._counted(init=sources.init, error=error),
                                            **self._formatted(sources.format))
