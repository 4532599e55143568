"""The launches of ``csrc/cuda/hash_table.cu``: hash, find, insert, undo, grow, erase, expire."""

from typing import Optional, Tuple

import numpy as np
import torch

from dynamicemb.ops.cuda.launch import (_MAX_BUCKET_CAPACITY, _NUM_OUTCOMES, KernelLauncher,
                                        _expect, _expect_batch, _i64, _ptr, _table_args)

__all__ = ["HashTableKernels"]


class HashTableKernels(KernelLauncher):
    """The hash table verbs of ``CudaKernels``."""

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

    def _pass(self, meta, bc, keys, tids, given, rule, evicts, one_table, buckets, outcomes,
              size, now_at: Optional[torch.Tensor], table_scores: Optional[torch.Tensor],
              ttl: int) -> Tuple[torch.Tensor, ...]:
        """``Backend.upsert``'s pass; its time is ``now_at`` (1,) on the device."""
        _expect(outcomes, torch.int64, "outcomes")
        _expect(size, torch.int64, "size")
        if outcomes.numel() != _NUM_OUTCOMES + 1 or size.numel() != 1:
            raise ValueError(f"outcomes must hold {_NUM_OUTCOMES + 1} counts (the expired "
                             f"hits last), size one")
        if table_scores is not None:
            _expect(table_scores, torch.int64, "table_scores")
        if rule != 0 and given is None and not (rule == 2 and table_scores is not None):
            raise ValueError("the count and given-score rules need scores")
        if bc > _MAX_BUCKET_CAPACITY:
            raise ValueError(f"the CUDA backend inserts into buckets of at most "
                             f"{_MAX_BUCKET_CAPACITY} slots, got bucket_capacity={bc}")
        n = keys.numel()
        outs = tuple(torch.empty(n, dtype=dtype, device=keys.device) for dtype in (
            torch.int64, torch.int8, torch.int64, torch.int64, torch.int16, torch.int64))
        if n == 0:
            return outs
        sorted_buckets, order = torch.sort(buckets, stable=True)
        self._launch("demb_upsert", keys.device, 32 * ((n + 31) // 32), _table_args(meta, bc) + [
            _ptr(keys), _ptr(tids), _ptr(given), np.int32(rule), np.bool_(evicts),
            np.bool_(one_table), _ptr(sorted_buckets), _ptr(order), _i64(n),
            *[_ptr(t) for t in outs], _ptr(outcomes), _ptr(now_at), _ptr(size),
            _ptr(table_scores), np.uint64(ttl)])  # a warp per 32 positions
        return outs

    def dedup_upsert(self, meta, bc, keys, tids, frequencies, rule, time, now_index,
                     evicts, one_table, error, outcomes, size, part=None, table_scores=None,
                     ttl=0):
        """``Backend.dedup_upsert``: the dedup's tuple, then the pass's (padding: FAILED)."""
        table = _table_args(meta, bc)
        _expect(time, torch.int64, "time")
        if time.numel() != 2 or now_index not in (0, 1):
            raise ValueError("time holds a clock and a step; now_index picks one")
        if rule == 2 and table_scores is None:
            raise ValueError("the given-score rule of a deduplicating call reads each "
                             "table's score: table_scores")
        unique, buckets = self._dedup(keys, tids, frequencies, True, num_buckets=int(table[5]),
                                      error=error, time=time, part=part)
        ukeys, utids, inverse, counts, starts, rank = unique
        given = counts if rule in (1, 3) else None
        outs = self._pass(meta, bc, ukeys, utids, given, rule, evicts, one_table, buckets,
                          outcomes, size, time[now_index:now_index + 1],
                          table_scores if rule == 2 else None, ttl)
        return (ukeys, utids, inverse, counts, starts, rank, *outs)

    def upsert(self, meta, bc, keys, tids, scores, rule, evicts, one_table, buckets,
               outcomes, size, time=None, now_index=0, ttl=0):
        """``Backend.upsert``: (slots, status, prev_scores, ev_keys, ev_tids, ev_scores)."""
        _expect_batch(keys, tids)
        n = keys.numel()
        table = _table_args(meta, bc)
        if buckets is None:
            buckets = torch.empty(n, dtype=torch.int32, device=keys.device)
            self._launch("demb_buckets_of", keys.device, n, [
                _ptr(keys), _ptr(tids), _i64(n), table[5], _ptr(buckets)])
        else:
            _expect(buckets, torch.int32, "buckets")
            if buckets.shape != (n,):
                raise ValueError("buckets are given for every key of a pass: (n,) int32")
        now_at = None
        if time is not None:
            _expect(time, torch.int64, "time")
            if time.numel() != 2 or now_index not in (0, 1):
                raise ValueError("time holds a clock and a step; now_index picks one")
            now_at = time[now_index:now_index + 1]
        return self._pass(meta, bc, keys, tids, scores, rule, evicts, one_table, buckets,
                          outcomes, size, now_at, None, ttl)

    def erase_where(self, meta, bc, keys, tids, status, which, erased, size) -> None:
        """``Backend.erase_where``."""
        _expect_batch(keys, tids)
        _expect(status, torch.int8, "status")
        _expect(erased, torch.int64, "erased")
        _expect(size, torch.int64, "size")
        self._launch("demb_erase_where", keys.device, keys.numel(), _table_args(meta, bc) + [
            _ptr(keys), _ptr(tids), _ptr(status), np.int32(which), _i64(keys.numel()),
            _ptr(erased), _ptr(size)])


    def undo_upsert(self, meta, bc, slots, status, prev_scores, ev_keys, ev_tids,
                    ev_scores) -> None:
        """Reverts an inserting call: each slot by the oldest key that touched it (a stable
        sort by slot), whose record holds the slot as it was."""
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
        """Erases each key once (its first occurrence)."""
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
        """``Backend.expire``."""
        if before < 0:
            raise ValueError(f"before must be >= 0, got {before}")
        expired = torch.empty(meta[2].numel(), dtype=torch.bool, device=meta[2].device)
        self._launch("demb_expire", expired.device, expired.numel(), _table_args(meta, bc) + [
            np.uint64(time_mask & 0xFFFFFFFFFFFFFFFF), np.uint64(before), _ptr(expired)])
        return expired

    def occupied_slots(self, meta, bc, start, end) -> torch.Tensor:
        """Occupied slots of [start, end), ascending (digest 0: empty)."""
        return (meta[3][start:end] != 0).nonzero().squeeze(1) + start
