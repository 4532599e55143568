"""The launches of ``csrc/cuda/dedup.cu``: the unique (table id, key) pairs of a batch."""

from typing import Optional, Tuple

import numpy as np
import torch

from dynamicemb.ops.cuda.launch import (KernelLauncher, _error_arg, _expect_batch, _i64,
                                        _ptr)

__all__ = ["DedupKernels"]


class DedupKernels(KernelLauncher):
    """The dedup verbs of ``CudaKernels``."""

    def _first_positions(self, keys: torch.Tensor, tids: torch.Tensor, zeros: int = 0,
                         part=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n,) int64 each: the first position of each position's pair (-1: left out by
        ``part``) and whether it is that first one; plus ``zeros`` zeros for the caller."""
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

    def dedup(self, keys, tids, error, part=None, frequencies=None, group=False, time=None):
        """``Backend.dedup`` as (keys, tids, inverse, counts, starts, rank); starts and rank
        empty unless ``group``."""
        return self._dedup(keys, tids, frequencies, group, error=error, time=time,
                           part=part)[0]

    def _dedup(self, keys, tids, frequencies, grouped: bool, num_buckets: Optional[int] = None,
               error: Optional[torch.Tensor] = None, time: Optional[torch.Tensor] = None,
               part=None):
        """``dedup``'s tuple, and each unique pair's bucket ((N,) int32) given ``num_buckets``."""
        _expect_batch(keys, tids)
        n = keys.numel()
        dev = keys.device
        # zeros for the occurrences (U,), counted by atomics, and the grouping's
        # starts (U + 1,) whose first entry is 0, U <= n
        first, is_first, zeroed = self._first_positions(keys, tids,
                                                        zeros=2 * n + 1 if grouped else n,
                                                        part=part)
        number = torch.cumsum(is_first, 0)  # pair first seen at i: number[i] - 1
        u = n  # the unique count is at most n
        ukeys = torch.empty(u, dtype=torch.int64, device=dev)
        utids = torch.empty(u, dtype=tids.dtype, device=dev)
        inverse = torch.empty(n, dtype=torch.int64, device=dev)
        occurrences = zeroed[:u]
        buckets = (None if num_buckets is None
                   else torch.empty(u, dtype=torch.int32, device=dev))
        self._launch("demb_dedup_number", dev, n if time is None else max(n, 1), [
            _ptr(keys), _ptr(tids), _ptr(first), _ptr(number), _i64(n), _ptr(ukeys),
            _ptr(utids), _ptr(inverse), _ptr(occurrences), _i64(num_buckets or 0),
            _ptr(buckets), _error_arg(error), _ptr(time)])
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
        """Stable counting sort of ``inverse``: fills ``starts`` (U + 1,; its first entry given
        as 0) from the occurrences (U,), returns rank (N,); ``left_out``: inverse -1 ranks -1."""
        n = inverse.numel()
        torch.cumsum(occurrences, 0, out=starts[1:])
        key = torch.where(inverse >= 0, inverse, n) if left_out else inverse
        order = torch.sort(key, stable=True).indices
        rank = torch.empty(n, dtype=torch.int64, device=inverse.device)
        rank[order] = torch.arange(n, device=inverse.device)
        if left_out:  # another group's lookups place no gradient (rank -1)
            rank = torch.where(inverse >= 0, rank, -1)
        return starts, rank
