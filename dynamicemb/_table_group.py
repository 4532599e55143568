"""A physical group of logical tables: one hash table, one optimizer, one dim.

``BatchedDynamicEmbeddingTables`` fuses the tables whose physical options agree
(dim, score strategy, bucket capacity, load factor, check mode, training flag,
optimizer settings, admission) into one ``_TableGroup``: one dedup, one hash
table call and one fused backward per group and batch. The capacity of a group
is the sum of its tables' capacities, shared by them.
"""

import math
from dataclasses import astuple, dataclass
from typing import List, NamedTuple, Optional

import torch

from dynamicemb._ops import ops_for
from dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbTableOptions,
)
from dynamicemb.table import ScoredHashTable
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
    )


class Lookup(NamedTuple):
    """What a group's forward hands to its backward.

    Shape:
        keys, tids: (U,) unique (key, local table) pairs; inverse: (N,) unique
        index of each lookup (-1: lookup of another group); row_slot: (U,) slot
        of each unique row, or -(t + 1) for row t of ``transient`` ([T, dim]).
    """

    keys: torch.Tensor
    tids: torch.Tensor
    inverse: torch.Tensor
    row_slot: torch.Tensor
    transient: torch.Tensor
    generation: int


@dataclass
class _TableInit:
    """A table's initializers with its default bounds resolved."""

    table_index: int  # global index in the module: part of every row's random stream
    train: DynamicEmbInitializerArgs
    eval: DynamicEmbInitializerArgs
    max_capacity: int


class _TableGroup:
    """One physical hash table holding the rows of several logical tables."""

    def __init__(
        self,
        table_indices: List[int],
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
            _TableInit(t, o.initializer_args, o.eval_initializer_args, o.max_capacity)
            for t, o in zip(table_indices, options)
        ]
        self.table = ScoredHashTable(
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
        self.custom_scores = torch.zeros(len(table_indices), dtype=torch.int64)
        self.adam_step = 0

    # ------------------------------------------------------------- forward
    def lookup(self, keys: torch.Tensor, tids: torch.Tensor, insert: bool) -> Lookup:
        """Dedups the lookups, finds (and in training inserts) their rows.

        Args:
            keys (Tensor): (N,) int64 ids of this group's lookups.
            tids (Tensor): (N,) int16 local table ids.
            insert: training: insert admitted unseen keys; else only find.
        """
        ukeys, utids, inverse, counts = self.ops.dedup(keys, tids)
        if insert and self.training:
            row_slot = self._find_or_insert(ukeys, utids, counts)
        else:
            row_slot = self.table.find(ukeys, utids)
        transient = self._transient_rows(ukeys, utids, row_slot, train=insert and self.training)
        return Lookup(ukeys, utids, inverse, row_slot, transient, self.table.generation)

    def _admitted(self, keys, tids, counts) -> torch.Tensor:
        """Mask of unique keys that may be stored: present ones, and new ones whose
        occurrence count reached the threshold (their counters are then dropped)."""
        present = self.table.find(keys, tids) >= 0
        new = (~present).nonzero().squeeze(1)
        if new.numel() == 0:
            return present
        counted = self.counter.find_or_insert(keys[new], tids[new])
        ok = counted.slots >= 0
        slots = counted.slots[ok]
        self.counter.values[slots, 0] += counts[new][ok].double()
        reached = torch.zeros_like(ok)
        reached[ok] = self.counter.values[slots, 0] >= self.admission.threshold
        admitted = present.clone()
        admitted[new[reached]] = True
        self.counter.erase(keys[new[reached]], tids[new[reached]].long())
        return admitted

    def _find_or_insert(self, keys, tids, counts) -> torch.Tensor:
        admitted = None if self.counter is None else self._admitted(keys, tids, counts)
        if admitted is not None:
            keys, tids = keys[admitted], tids[admitted]
        scores = None
        if self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
            scores = self.custom_scores[tids.long()]
        result = self.table.find_or_insert(keys, tids.long(), scores)
        new = result.inserted.nonzero().squeeze(1)
        if new.numel():
            self._init_stored_rows(result.slots[new], keys[new], tids[new])
        if admitted is None:
            return result.slots
        row_slot = torch.full(admitted.shape, -1, dtype=torch.int64, device=self.device)
        row_slot[admitted] = result.slots
        return row_slot

    def _init_stored_rows(self, slots, keys, tids) -> None:
        values = self.table.values
        self._fill(values, slots, keys, tids, train=True)
        if self.state_dim:
            initial = self.optimizer.initial_accumulator_value
            adagrad = self.optimizer.optimizer in (
                DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD)
            values[slots, self.dim:] = initial if adagrad else 0.0

    def _transient_rows(self, keys, tids, row_slot, train: bool) -> torch.Tensor:
        """Initialized rows for unique keys without a stored row (row_slot < 0)."""
        missing = (row_slot < 0).nonzero().squeeze(1)
        transient = torch.empty(missing.numel(), self.dim, dtype=torch.float32, device=self.device)
        if missing.numel():
            rows = torch.arange(missing.numel(), dtype=torch.int64, device=self.device)
            row_slot[missing] = -(rows + 1)
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
                out, r.contiguous(), k.contiguous(), init.table_index, self.dim,
                _INIT_MODE_CODE[args.mode], args.mean, args.std_dev, lower, upper,
                args.value, args.seed,
            )

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
        row_slot = lookup.row_slot
        if lookup.generation != self.table.generation:
            # Rows moved (growth) or left (eviction) since the forward: find them
            # again; rows that are gone get no update.
            row_slot = row_slot.clone()
            stored = (row_slot >= 0).nonzero().squeeze(1)
            row_slot[stored] = self.table.find(lookup.keys[stored], lookup.tids[stored].long())
        opt = self.optimizer
        step_size, bias2_sqrt = lr, 1.0
        if opt.optimizer == DynamicEmbOptimType.ADAM:
            self.adam_step += 1
            step_size = lr / (1 - opt.beta1 ** self.adam_step)
            bias2_sqrt = math.sqrt(1 - opt.beta2 ** self.adam_step)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self.ops.fused_backward(
            self.table.values, row_slot, lookup.inverse,
            empty if offsets is None else offsets, weights, feature_col, batch, self.dim,
            mean, grad, _OPTIMIZER_CODE[opt.optimizer], lr, opt.eps, opt.beta1, opt.beta2,
            opt.weight_decay, step_size, bias2_sqrt,
        )
