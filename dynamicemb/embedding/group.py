"""A physical group of logical tables: one hash table, one optimizer, one dim.

``BatchedDynamicEmbeddingTables`` fuses the tables whose physical options agree
(dim, score strategy, bucket capacity, load factor, check mode, training flag,
optimizer settings, admission) into one ``_TableGroup``: one dedup, one hash
table call and one fused backward per group and batch. The capacity of a group
is the sum of its tables' capacities, shared by them.
"""

import math
import zlib
from dataclasses import astuple, dataclass
from typing import List, NamedTuple, Optional

import torch

from dynamicemb.ops import ops_for
from dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbTableOptions,
)
from dynamicemb.storage import TieredStorage
from dynamicemb.table import PendingInsert, ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy

_INIT_MODE_CODE = {
    DynamicEmbInitializerMode.NORMAL: 0,
    DynamicEmbInitializerMode.TRUNCATED_NORMAL: 1,
    DynamicEmbInitializerMode.UNIFORM: 2,
    DynamicEmbInitializerMode.CONSTANT: 3,
    DynamicEmbInitializerMode.DEBUG: 4,
}

# Kernel codes (csrc/dynamicemb/optimizer_primitives.h) and state floats per row.
_OPTIMIZER_CODE = {
    DynamicEmbOptimType.EXACT_SGD: 0,
    DynamicEmbOptimType.ADAM: 1,
    DynamicEmbOptimType.EXACT_ADAGRAD: 2,
    DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 3,
}


def optimizer_state_dim(optimizer: DynamicEmbOptimType, dim: int) -> int:
    """Floats of optimizer state stored after the embedding in each value row."""
    return {
        DynamicEmbOptimType.EXACT_SGD: 0,
        DynamicEmbOptimType.ADAM: 2 * dim,
        DynamicEmbOptimType.EXACT_ADAGRAD: dim,
        DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 1,
    }[optimizer]


def init_stream(table_name: str) -> int:
    """A table's stable identity in the initializer's random stream: the CRC-32 of its
    name. A key therefore starts with the same row in every module that names the
    table alike (sharded or not, whatever its position)."""
    return zlib.crc32(table_name.encode("utf-8"))


def group_key(options: DynamicEmbTableOptions, optimizer: DynamicEmbOptimizerArgs) -> tuple:
    """Tables with equal keys share one physical group."""
    return (
        options.dim,
        options.score_strategy,
        options.bucket_capacity,
        options.max_load_factor,
        options.safe_check_mode,
        options.training,
        astuple(optimizer),
        options.admit_strategy,
        options.caching,
        options.local_hbm_for_values is None,
    )


class Lookup(NamedTuple):
    """What a group's forward hands to its backward.

    Shape:
        keys, tids: (U,) unique (key, local table) pairs; inverse: (N,) unique
        index of each lookup (-1: lookup of another group); row_ref: (U,) where
        each unique row lives (``dynamicemb.storage``; -(t + 1) for row t of
        ``transient``, [T, dim]); generation: the storage's, when looked up;
        starts (U + 1,) and rank (N,): this group's lookups grouped by unique row
        (``Deduplicated``; rank -1: another group's lookup), for the backward;
        None when the lookup does not train.
    """

    keys: torch.Tensor
    tids: torch.Tensor
    inverse: torch.Tensor
    row_ref: torch.Tensor
    transient: torch.Tensor
    generation: tuple
    starts: Optional[torch.Tensor]
    rank: Optional[torch.Tensor]


class _PendingLookup(NamedTuple):
    """A lookup between its two phases (``begin_lookup`` / ``finish_lookup``)."""

    keys: torch.Tensor  # (U,) unique keys
    tids: torch.Tensor  # (U,) int16
    inverse: torch.Tensor  # (N,)
    counts: torch.Tensor  # (U,) occurrences in the batch
    starts: Optional[torch.Tensor]  # (U + 1,) training: lookups grouped by unique key
    rank: Optional[torch.Tensor]  # (N,)
    admitted: Optional[torch.Tensor]  # (U,) bool, None: no admission
    insert: Optional[PendingInsert]  # training: the prepared insert
    found: Optional[torch.Tensor]  # eval: row references found
    train: bool


@dataclass
class _TableInit:
    """A table's initializers with its default bounds resolved."""

    stream: int  # the table's identity in every row's random stream (from its name)
    train: DynamicEmbInitializerArgs
    eval: DynamicEmbInitializerArgs
    max_capacity: int


class _TableGroup:
    """One physical hash table holding the rows of several logical tables."""

    def __init__(
        self,
        table_indices: List[int],
        table_names: List[str],
        options: List[DynamicEmbTableOptions],
        optimizer: DynamicEmbOptimizerArgs,
        device: torch.device,
    ) -> None:
        first = options[0]
        self.table_indices = table_indices
        self.dim = first.dim
        self.training = first.training
        self.optimizer = optimizer
        self.state_dim = optimizer_state_dim(optimizer.optimizer, self.dim) if self.training else 0
        self.score_strategy = first.score_strategy
        self.admission = first.admit_strategy
        self.device = device
        self.ops = ops_for(device)
        self.inits = [
            _TableInit(init_stream(name), o.initializer_args, o.eval_initializer_args,
                       o.max_capacity)
            for name, o in zip(table_names, options)
        ]
        self.table = ScoredHashTable(  # the host store: index of record
            num_tables=len(table_indices),
            capacity=sum(o.init_capacity or o.max_capacity for o in options),
            max_capacity=sum(o.max_capacity for o in options),
            bucket_capacity=first.bucket_capacity,
            score_strategy=first.score_strategy,
            max_load_factor=first.max_load_factor,
            value_dim=self.dim + self.state_dim,
            check_mode=first.safe_check_mode,
            device=device,
        )
        row_bytes = (self.dim + self.state_dim) * 4
        budgets = [o.local_hbm_for_values for o in options]
        device_rows = None if budgets[0] is None else sum(b // row_bytes for b in budgets)
        self.storage = TieredStorage.build(self.table, first.caching, device_rows)
        self.counter = None
        if self.admission is not None:
            self.counter = ScoredHashTable(
                num_tables=len(table_indices),
                capacity=self.admission.counter_capacity,
                max_load_factor=1.0,
                value_dim=1,
                value_dtype=torch.float64,
                device=device,
            )
        # On the rows' device: indexed by each batch's table ids.
        self.custom_scores = torch.zeros(len(table_indices), dtype=torch.int64, device=device)
        self.adam_step = 0
        self._no_transient = torch.empty(0, self.dim, dtype=torch.float32, device=device)

    # ------------------------------------------------------------- forward
    def begin_lookup(self, keys: torch.Tensor, tids: torch.Tensor, insert: bool,
                     frequencies: Optional[torch.Tensor] = None) -> "_PendingLookup":
        """Phase one of a lookup: dedup, admission decision, hash-table slots decided.

        Nothing observable changes until ``finish_lookup``; ``abort_lookup`` undoes
        the prepared insert, so a module can make a batch over several groups atomic.

        Args:
            keys (Tensor): (N,) int64 ids of this group's lookups.
            tids (Tensor): (N,) int16 local table ids.
            insert: training: insert admitted unseen keys; else only find.
            frequencies (Tensor, optional): (N,) int64 occurrences each lookup stands
                for (ids deduplicated upstream); default 1.
        """
        train = insert and self.training
        if train and self.counter is None and self.score_strategy != DynamicEmbScoreStrategy.CUSTOMIZED:
            # Nothing to decide between the dedup and the insert: one overlapped call.
            unique, pending = self.storage.prepare_dedup(keys, tids, frequencies)
            return _PendingLookup(*unique, None, pending, None, train=True)
        ukeys, utids, inverse, counts, starts, rank = self.ops.dedup(
            keys, tids, frequencies, train)
        if not train:
            refs = self.storage.resolve(ukeys, utids)
            return _PendingLookup(ukeys, utids, inverse, counts, None, None, None, None, refs,
                                  train=False)
        admitted = None if self.counter is None else self._admitted(ukeys, utids, counts)
        keys_in, tids_in, counts_in = ukeys, utids, counts
        if admitted is not None:
            keys_in, tids_in, counts_in = ukeys[admitted], utids[admitted], counts[admitted]
        scores = None
        if self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
            scores = self.custom_scores[tids_in.long()]
        elif self.score_strategy == DynamicEmbScoreStrategy.LFU:
            scores = counts_in  # LFU counts occurrences, not batches
        pending = self.storage.prepare(keys_in, tids_in, scores)
        return _PendingLookup(ukeys, utids, inverse, counts, starts, rank, admitted, pending, None,
                              train=True)

    def abort_lookup(self, pending: "_PendingLookup") -> None:
        if pending.insert is not None:
            pending.insert.abort()

    def finish_lookup(self, pending: "_PendingLookup") -> Lookup:
        """Phase two: commit the insert, initialize new rows, place rows in their
        tiers, count admissions. Unique keys without a stored row get transient rows."""
        keys, tids = pending.keys, pending.tids
        if pending.insert is None:
            refs = pending.found
        elif pending.admitted is None:  # every unique key went to the host store
            result = self.storage.commit(pending.insert)
            if result.num_inserted:
                new_at = result.inserted.nonzero().squeeze(1)
                self._init_stored_rows(result.slots[new_at], keys[new_at], tids[new_at])
            refs = self.storage.place(keys, tids, result.slots, result.inserted, pending.counts,
                                      num_stored=keys.numel() - result.num_failed)
            if result.num_failed == 0:  # every row stored: no transient rows
                return Lookup(keys, tids, pending.inverse, refs, self._no_transient,
                              self.storage.generation, pending.starts, pending.rank)
        else:
            at = pending.admitted.nonzero().squeeze(1)
            result = self.storage.commit(pending.insert)
            new_at = result.inserted.nonzero().squeeze(1)
            if new_at.numel():
                self._init_stored_rows(result.slots[new_at], keys[at][new_at], tids[at][new_at])
            host_slots = torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
            host_slots[at] = result.slots
            new = torch.zeros_like(pending.admitted)
            new[at[new_at]] = True
            refs = self.storage.place(keys, tids, host_slots, new, pending.counts)
            self._count_occurrences(pending, at[new_at])
        transient = self._transient_rows(keys, tids, refs, train=pending.train)
        return Lookup(keys, tids, pending.inverse, refs, transient, self.storage.generation,
                      pending.starts, pending.rank)

    def _admitted(self, keys, tids, counts) -> torch.Tensor:
        """Mask of unique keys that may be stored (read-only): present ones, and new
        ones whose counted occurrences, with this batch's, reach the threshold."""
        admitted = self.table.find(keys, tids) >= 0  # the host store indexes every key
        new = (~admitted).nonzero().squeeze(1)
        if new.numel():
            slots = self.counter.find(keys[new], tids[new])
            seen = torch.where(slots >= 0, self.counter.values[slots.clamp(min=0), 0],
                               torch.zeros((), dtype=torch.float64, device=self.device))
            admitted[new] = seen + counts[new].double() >= self.admission.threshold
        return admitted

    def _count_occurrences(self, pending: "_PendingLookup", stored_now: torch.Tensor) -> None:
        """After a committed insert: forget the counters of keys just stored (positions
        ``stored_now``), and add this batch's occurrences of keys still waiting."""
        keys, tids, counts = pending.keys, pending.tids, pending.counts
        self.counter.erase(keys[stored_now], tids[stored_now])
        waiting = (~pending.admitted).nonzero().squeeze(1)
        if waiting.numel():
            counted = self.counter.find_or_insert(keys[waiting], tids[waiting])
            ok = counted.slots >= 0
            self.counter.values[counted.slots[ok], 0] += counts[waiting][ok].double()

    def _init_stored_rows(self, slots, keys, tids) -> None:
        values = self.table.values
        self._fill(values, slots, keys, tids, train=True)
        if self.state_dim:
            initial = self.optimizer.initial_accumulator_value
            adagrad = self.optimizer.optimizer in (
                DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD)
            values[slots, self.dim:] = initial if adagrad else 0.0

    def _transient_rows(self, keys, tids, refs, train: bool) -> torch.Tensor:
        """Initialized rows for unique keys without a stored row (refs < 0); their
        references become -(t + 1) for transient row t."""
        if refs.numel() == 0 or int(refs.min()) >= 0:  # every row stored (the common case)
            return self._no_transient
        missing = (refs < 0).nonzero().squeeze(1)
        transient = torch.empty(missing.numel(), self.dim, dtype=torch.float32, device=self.device)
        if missing.numel():
            rows = torch.arange(missing.numel(), dtype=torch.int64, device=self.device)
            refs[missing] = -(rows + 1)
            self._fill(transient, rows, keys[missing], tids[missing], train=train)
        return transient

    def _fill(self, out, rows, keys, tids, train: bool) -> None:
        """out[rows, :dim] = each key's initializer row (per logical table)."""
        for local, init in enumerate(self.inits):
            mine = (tids == local).nonzero().squeeze(1) if len(self.inits) > 1 else None
            r, k = (rows, keys) if mine is None else (rows[mine], keys[mine])
            if r.numel() == 0:
                continue
            args = init.train if train else init.eval
            lower, upper = args.bounds(init.max_capacity)
            self.ops.init_rows(
                out, r.contiguous(), k.contiguous(), init.stream, self.dim,
                _INIT_MODE_CODE[args.mode], args.mean, args.std_dev, lower, upper,
                args.value, args.seed,
            )

    def refresh(self, lookup: Lookup) -> Lookup:
        """The lookup with its row references found again if rows moved since (growth,
        promotion, eviction); rows that left the table get no update in backward."""
        if lookup.generation == self.storage.generation:
            return lookup
        refs = lookup.row_ref.clone()
        stored = (refs >= 0).nonzero().squeeze(1)
        found = self.storage.resolve(lookup.keys[stored], lookup.tids[stored])
        gone = found < 0
        if bool(gone.any()):  # keep reading something defined: the initializer's row
            extra = torch.zeros(int(gone.sum()), self.dim, dtype=torch.float32, device=self.device)
            rows = (torch.arange(extra.shape[0], dtype=torch.int64, device=self.device)
                    + lookup.transient.shape[0])
            self._fill(extra, rows - lookup.transient.shape[0], lookup.keys[stored][gone],
                       lookup.tids[stored][gone], train=True)
            found[gone] = -(rows + 1)
            lookup = lookup._replace(transient=torch.cat([lookup.transient, extra]))
        refs[stored] = found
        return lookup._replace(row_ref=refs, generation=self.storage.generation)

    # ------------------------------------------------------------ backward
    def apply_gradients(
        self,
        lookup: Lookup,
        grad: torch.Tensor,
        lr: float,
        offsets: Optional[torch.Tensor],
        weights: Optional[torch.Tensor],
        feature_col: torch.Tensor,
        batch: int,
        mean: bool,
    ) -> None:
        """Sums each stored row's gradient and applies the fused optimizer."""
        if not self.training:
            return
        refs = self.refresh(lookup).row_ref
        opt = self.optimizer
        step_size, bias2_sqrt = lr, 1.0
        if opt.optimizer == DynamicEmbOptimType.ADAM:
            self.adam_step += 1
            step_size = lr / (1 - opt.beta1 ** self.adam_step)
            bias2_sqrt = math.sqrt(1 - opt.beta2 ** self.adam_step)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.ops.fused_backward(
            self.storage.tiers(), refs, lookup.starts, lookup.rank,
            empty if offsets is None else offsets, weights, feature_col, batch, self.dim,
            mean, grad, _OPTIMIZER_CODE[opt.optimizer], lr, opt.eps, opt.beta1, opt.beta2,
            opt.weight_decay, step_size, bias2_sqrt,
        )
