"""A physical group of logical tables: one hash table, one optimizer, one dim.

``BatchedDynamicEmbeddingTables`` fuses the tables whose physical options agree
(dim, score strategy, bucket capacity, load factor, check mode, training flag,
optimizer settings, admission) into one ``TableGroup``: one dedup, one hash
table call and one fused backward per group and batch. The capacity of a group
is the sum of its tables' capacities, shared by them. The group is the only
caller of the embedding kernels.
"""

from dataclasses import astuple
from typing import Iterator, List, NamedTuple, Optional

import torch

from dynamicemb.embedding.admission import Admission
from dynamicemb.embedding.initialization import RowInitializer, init_stream
from dynamicemb.embedding.records import ExportedRows, TableClocks
from dynamicemb.ops import for_device
from dynamicemb.ops.interface import (HOST_ROW_BIT, TRANSIENT_ROW_BIT, BatchPart,
                                      DeviceSchedule, InitRows, OptimizerUpdate, Rounding,
                                      RowFormat, RowSources, num_buckets_for,
                                      optimizer_state_dim)
from dynamicemb.options import (DynamicEmbOptimizerArgs, DynamicEmbOptimType, DynamicEmbTableOptions,
                                DynamicEmbWeightDecayMode)
from dynamicemb.storage import TieredStorage, TierMetrics
from dynamicemb.storage.external import ExternalStorageError, namespace_of, open_store
from dynamicemb.storage.external.tier import ExternalTier
from dynamicemb.table import MAX_TABLES, ScoredHashTable
from dynamicemb.table.device_counts import DeviceCounters, capturing
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["GroupLookup", "TableGroup", "group_key"]


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
        # tables with KVCounters of any capacity share one counter table (their sum);
        # without admit_strategy a counter counts nothing
        None if options.admission_counter is None or options.admit_strategy is None else (
            options.admission_counter.bucket_capacity, options.admission_counter.key_type),
        options.caching,
        options.device_budget() is None,
        options.ttl,
        options.external_storage,
        options.local_host_for_values is None,
        options.row_dtype,
        options.stochastic_rounding,
        options.rounding_seed,
    )


def host_budget_rows(options: List[DynamicEmbTableOptions], row_bytes: int,
                     table_names: List[str]) -> int:
    """The host store's most rows: the tables' ``max_capacity``, or with an external
    store and ``local_host_for_values`` the largest power-of-two number of buckets
    within that budget."""
    total = sum(o.max_capacity for o in options)
    budgets = [o.local_host_for_values for o in options]
    if budgets[0] is None:
        return total
    bucket = options[0].bucket_capacity
    rows = sum(b // row_bytes for b in budgets)
    if rows < bucket:
        raise ValueError(f"tables {table_names}: local_host_for_values holds {rows} rows of "
                         f"{row_bytes} B, less than one bucket ({bucket} rows)")
    return min(total, bucket << ((rows // bucket).bit_length() - 1))


def external_tier(options: DynamicEmbTableOptions, host: ScoredHashTable,
                  table_names: List[str], row_format: RowFormat) -> Optional[ExternalTier]:
    """The external tier of a group of rows of ``row_format`` whose first table's
    ``options`` name a store."""
    if options.external_storage is None:
        return None
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    try:
        store = open_store(options.external_storage, namespace_of(table_names, rank),
                           host.value_dim, row_format.tag)
    except ExternalStorageError as e:  # locked, unreachable, another module's rows or format
        raise ExternalStorageError(f"{e} (tables {table_names})") from e
    return ExternalTier(store, host, str(table_names), row_format)


def device_budget_rows(options: List[DynamicEmbTableOptions], row_bytes: int,
                       table_names: List[str]) -> Optional[int]:
    """Rows of the tables' device budget (None: no budget, every row on the device);
    a budget below one bucket of 16 rows (but not 0, a host-only table) is refused."""
    budgets = [o.device_budget() for o in options]
    if budgets[0] is None:
        return None
    rows = sum(b // row_bytes for b in budgets)
    if 0 < sum(budgets) and rows < 16:
        raise ValueError(
            f"tables {table_names}: local_hbm_for_values/global_hbm_for_values hold {rows} "
            f"rows of {row_bytes} B, less than a device tier's smallest bucket (16 rows): "
            f"give them at least {16 * row_bytes} B together, 0 for a host-only table, or None "
            f"for every row in device memory")
    return rows


class GroupLookup(NamedTuple):
    """One group's lookup of a batch, from ``begin_lookup`` (the dedup) through
    ``finish_lookup`` (row references, transient rows) to its backward.

    Shape:
        keys, tids: (U,) unique (key, local table id) pairs; inverse: (N,) unique
        index of each lookup (-1: a lookup of another group); counts: (U,)
        occurrences in the batch; starts (U + 1,) and rank (N,): the lookups grouped
        by unique row for the backward (rank -1: another group's lookup), None when
        the lookup does not train; row_ref: (U,) where each unique row lives
        (``dynamicemb.storage``; ``TRANSIENT_ROW_BIT`` + t for row t of
        ``transient``, [T, dim]; negative: computed from ``init``);
        generation: the storage's when looked up; admitted: (N,) bool (the keys
        the insert took), None without admission. U-sized arrays have N entries:
        the unique rows, then padding (no lookup, reference -1).
    """

    keys: torch.Tensor
    tids: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    starts: Optional[torch.Tensor] = None
    rank: Optional[torch.Tensor] = None
    row_ref: Optional[torch.Tensor] = None
    transient: Optional[torch.Tensor] = None
    generation: Optional[tuple] = None
    admitted: Optional[torch.Tensor] = None
    init: Optional[InitRows] = None


class TableGroup:
    """One physical hash table holding the rows of several logical tables.

    Args:
        table_indices: the module's indices of the group's tables.
        table_names, options: theirs, in local table id order.
        optimizer: the group's optimizer settings.
        device: where rows, lookups and outputs live.
    """

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
        self.device = device
        self.ops = for_device(device)
        if self.ops.max_dim is not None and self.dim > self.ops.max_dim:
            raise ValueError(
                f"tables {table_names} have dim {self.dim}; the kernels for {device} take "
                f"at most {self.ops.max_dim}")
        self.init = RowInitializer(table_names, options, self.dim, optimizer,
                                   self.state_dim)
        self.row_format = RowFormat(first.row_dtype, self.dim, self.state_dim)
        host_rows = host_budget_rows(options, self.row_format.row_bytes, table_names)
        device_rows = device_budget_rows(options, self.row_format.row_bytes, table_names)
        self.table = ScoredHashTable(  # the host store: index of record
            num_tables=len(table_indices),
            capacity=min(sum(o.init_capacity or o.max_capacity for o in options), host_rows),
            max_capacity=host_rows,
            bucket_capacity=first.bucket_capacity,
            score_strategy=first.score_strategy,
            max_load_factor=first.max_load_factor,
            value_dim=self.row_format.storage_width,
            value_dtype=self.row_format.storage_dtype,
            check_mode=first.safe_check_mode,
            device=device,
            ttl=first.ttl,
            # under a device budget the host store's rows are in host memory (on a
            # GPU: pinned, read and written in place by the kernels); its index
            # stays on the device
            values_in_host_memory=TieredStorage.host_store_off_device(
                first.caching, device_rows,
                num_buckets_for(host_rows, first.bucket_capacity) * first.bucket_capacity),
        )
        self.storage = TieredStorage.build(
            self.table, self.row_format, first.caching, device_rows, device=device,
            new_rows=self.init.new_rows(device),
            external=external_tier(first, self.table, table_names, self.row_format))
        if first.admit_strategy is not None and 2 * len(table_indices) > MAX_TABLES + 1:
            raise ValueError(  # keys not admitted read spec rows T + t (int16 table ids)
                f"tables {table_names}: a group with admission holds at most "
                f"{(MAX_TABLES + 1) // 2} tables, got {len(table_indices)}: give some of "
                f"them other options (a group is the tables of one set of options)")
        self.admission = (None if first.admit_strategy is None
                          else Admission(first.admit_strategy,
                                         [o.admission_counter for o in options], device))
        # On the rows' device: indexed by each batch's table ids.
        self.custom_scores = torch.zeros(len(table_indices), dtype=torch.int64, device=device)
        # The update count (Adam's step; 16-bit rows' rounding step): set on the host,
        # advanced in device memory by a backward of a step counted on the device (its
        # learning rate is read there too)
        self._optimizer_step = DeviceCounters([0], device)
        self._counts_updates = (optimizer.optimizer == DynamicEmbOptimType.ADAM
                                or self.row_format.dtype != torch.float32)
        # each table's (stream, seed) of 16-bit rows' stochastic rounding (rounding_word)
        self._rounding_spec = torch.tensor(
            [[init_stream(n), o.rounding_seed] for n, o in zip(table_names, options)],
            dtype=torch.int64, device=device)
        self._stochastic = first.stochastic_rounding
        self._lr: Optional[torch.Tensor] = None
        self._lr_written: Optional[float] = None
        self._no_transient = torch.empty(0, self.dim, dtype=torch.float32, device=device)
        self._one = torch.ones(1, dtype=torch.int64, device=device)  # an eval lookup's count

    @property
    def train_steps(self) -> int:
        """Training steps so far (the table's step: the STEP strategy scores a
        batch's keys with ``train_steps + 1``)."""
        return self.table.step

    @train_steps.setter
    def train_steps(self, steps: int) -> None:
        self.table.set_step(steps)

    @property
    def update_count(self) -> int:
        """Updates the group applied, counted with Adam (its bias correction) or 16-bit
        rows (their rounding step); 0 otherwise."""
        return self._optimizer_step.value(0)

    @update_count.setter
    def update_count(self, value: int) -> None:
        self._optimizer_step.set(0, value)

    def device_lr(self, lr: float) -> torch.Tensor:
        """(1,) float64: the learning rate in device memory, written when it changed
        (one ``fill_``, no sync).

        Raises:
            RuntimeError: when it changed while the stream is being captured into a
                CUDA graph (the write would be replayed): set it with
                ``set_learning_rate`` outside the capture.
        """
        if self._lr is None:
            self._lr = torch.zeros(1, dtype=torch.float64, device=self.device)
        if lr != self._lr_written:
            if capturing():
                raise RuntimeError(
                    "the learning rate changed since the last step while a CUDA graph is "
                    "being captured: call set_learning_rate before the capture")
            self._lr.fill_(lr)
            self._lr_written = lr
        return self._lr

    # ------------------------------------------------------------- lookup
    def begin_lookup(self, keys: torch.Tensor, tids: torch.Tensor, insert: bool,
                     frequencies: Optional[torch.Tensor], error: torch.Tensor,
                     part: Optional[BatchPart] = None) -> GroupLookup:
        """Phase one: dedup, admission, slots decided, counts left on the device.
        Nothing observable changes until ``finish_lookup``; ``abort_lookup`` undoes it.

        Args:
            keys (Tensor): (N,) int64 ids of the batch's lookups.
            tids (Tensor): (N,) int16 local table ids.
            insert: training: insert admitted unseen keys; else only find.
            frequencies (Tensor, optional): (N,) int64 occurrences each lookup stands
                for (ids deduplicated upstream); None: 1 each.
            error (Tensor): (1,) int64, the module's input-check word of this batch:
                a batch whose word is set changes nothing.
            part (``BatchPart``, optional): the lookups of this group (other groups'
                get inverse -1); None: every lookup is this group's.
        """
        if not (insert and self.training):  # eval: rows found, none inserted
            if self.storage.external.holds_rows:  # absent rows may be below: each read
                unique, refs = self.storage.resolve_unique(keys, tids, error, part)  # once
                return GroupLookup(keys=unique.keys, tids=unique.table_ids,
                                   inverse=unique.inverse, counts=unique.counts, row_ref=refs,
                                   init=InitRows(unique.keys, unique.table_ids,
                                                 self.init.spec(False, self.device)))
            return self._lookup_each(keys, tids, part)
        scores = (self.custom_scores
                  if self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED else None)
        admitted = None
        if self.admission is None:
            unique = self.storage.prepare_dedup(keys, tids, frequencies, error=error,
                                                part=part, table_scores=scores)
        else:  # dedup -> stored here or below -> admission decides -> the insert
            unique = self.storage.dedup(keys, tids, frequencies, error=error, part=part)
            admitted = (unique.counts > 0) & self.admission.admitted(
                self.storage.stored(unique), unique.keys, unique.table_ids, unique.counts)
            self.storage.prepare_insert(unique, admitted, error=error, table_scores=scores)
        return GroupLookup(keys=unique.keys, tids=unique.table_ids, inverse=unique.inverse,
                           counts=unique.counts, starts=unique.starts, rank=unique.rank,
                           admitted=admitted, init=self._computed_rows(unique, admitted))

    def _lookup_each(self, keys: torch.Tensor, tids: torch.Tensor,
                     part: Optional[BatchPart]) -> GroupLookup:
        """An eval lookup without dedup: a probe per lookup costs less than a dedup."""
        n = keys.numel()
        inverse = torch.arange(n, dtype=torch.int64, device=self.device)
        if part is not None:
            inverse = torch.where(part.groups == part.group, inverse, -1)
        return GroupLookup(keys=keys, tids=tids, inverse=inverse, counts=self._one.expand(n),
                      row_ref=self.storage.resolve(keys, tids),
                      init=InitRows(keys, tids, self.init.spec(False, self.device)))

    def _computed_rows(self, unique, admitted: Optional[torch.Tensor]) -> InitRows:
        """Initializers of rows without a slot: the tables' (failed inserts); for keys
        not admitted the admission's where it has one (spec table id T + t)."""
        args = None if self.admission is None else self.admission.initializer_args
        if args is None:
            return InitRows(unique.keys, unique.table_ids, self.init.spec(True, self.device))
        waiting = (unique.counts > 0) & ~admitted
        tids = torch.where(waiting, unique.table_ids + len(self.table_indices),
                           unique.table_ids)
        return InitRows(unique.keys, tids, self.init.spec(True, self.device, others=args))

    def abort_lookup(self, lookup: GroupLookup) -> None:
        """Undoes ``begin_lookup``'s prepared insert (a training lookup's)."""
        if lookup.row_ref is None:
            self.storage.abort()

    def finish_lookup(self, lookup: GroupLookup) -> GroupLookup:
        """Phase two: commit the insert, count admissions; an eval lookup over an
        external tier reads the rows below as transient rows."""
        keys, tids, refs = lookup.keys, lookup.tids, lookup.row_ref
        if refs is None:  # training: the prepared insert
            refs, status = self.storage.commit(keys, tids, lookup.counts)
            if lookup.admitted is not None:
                self.admission.count_on_device(keys, tids, lookup.counts, lookup.admitted,
                                               status)
            return lookup._replace(row_ref=refs, transient=self._no_transient,
                                   generation=self.storage.generation)
        return lookup._replace(transient=self._rows_below(keys, tids, refs),
                               generation=self.storage.generation)

    def _rows_below(self, keys, tids, refs) -> torch.Tensor:
        """Rows below of keys without a row in memory (refs < 0, rewritten to
        ``TRANSIENT_ROW_BIT`` + t for transient row t)."""
        if not self.storage.external.holds_rows or refs.numel() == 0 or int(refs.min()) >= 0:
            return self._no_transient
        missing = (refs < 0).nonzero().squeeze(1)
        found, rows = self.storage.rows_below(keys[missing], tids[missing])
        refs[missing[found]] = TRANSIENT_ROW_BIT + torch.arange(
            found.numel(), dtype=torch.int64, device=self.device)
        return rows

    def refresh(self, lookup: GroupLookup) -> GroupLookup:
        """The lookup with its row references found again if rows moved since (growth,
        promotion, eviction); a row that left the table reads its initializer's row
        and gets no update in backward."""
        if lookup.generation == self.storage.generation:
            return lookup
        found = self.storage.resolve(lookup.keys, lookup.tids)
        refs = lookup.row_ref
        stored = (refs >= 0) & ((refs < TRANSIENT_ROW_BIT) | (refs >= HOST_ROW_BIT))
        refs = torch.where(stored, found, refs)
        return lookup._replace(row_ref=refs, generation=self.storage.generation)

    # ----------------------------------------------------------- per table
    # The module's per-table calls, for local table id ``local``; keys (n,) int64.
    def _tids(self, local: int, keys: torch.Tensor) -> torch.Tensor:
        return torch.full((keys.numel(),), local, dtype=torch.int16, device=self.device)

    def read_rows(self, local: int, keys: torch.Tensor, train: bool) -> torch.Tensor:
        """(n, dim) the rows of ``keys`` as a lookup reads them, changing nothing: a
        stored row from the tier holding it (the external tier's too), else the
        training (``train``) or eval initializer's row."""
        tids = self._tids(local, keys)
        refs = self.storage.resolve(keys, tids)
        transient = self._rows_below(keys, tids, refs)
        n = keys.numel()
        out = torch.empty(n, self.dim, dtype=torch.float32, device=self.device)
        if n:
            init = InitRows(keys, tids, self.init.spec(train, self.device))
            self.ops.sequence_forward(sources=self.storage.sources(transient, init),
                                      row_ref=refs, inverse=torch.arange(
                                          n, dtype=torch.int64, device=self.device),
                                      dim=self.dim, out=out)
        return out

    def holds(self, local: int, keys: torch.Tensor) -> torch.Tensor:
        """(n,) bool: whether a tier (the external one too) stores each key."""
        tids = self._tids(local, keys)
        return self.storage.or_below(keys, tids, self.storage.resolve(keys, tids) >= 0)

    def optimizer_states(self, local: int, keys: torch.Tensor) -> torch.Tensor:
        """(n, state_dim): stored rows' states, else the optimizer's initial state."""
        refs = self.storage.resolve(keys, self._tids(local, keys))
        return self.storage.states_of(refs, float(self.init.initial_state))

    def export(self, local: int, min_score: Optional[int]) -> ExportedRows:
        """Every stored row of one table scoring at least ``min_score``."""
        if self.storage.external.holds_rows:  # every tier's rows, chunk by chunk
            chunks = list(self.export_chunks(local, 1 << 16, min_score))
            return ExportedRows(*(torch.cat([getattr(c, f) for c in chunks])
                                  for f in ExportedRows._fields))
        return self._rows_of(local, self.storage.export(min_score=min_score))

    def export_chunks(self, local: int, chunk_slots: int,
                      min_score: Optional[int]) -> Iterator[ExportedRows]:
        """``export`` in chunks of at most ``chunk_slots`` rows."""
        for rows in self.storage.export_chunks(chunk_slots, min_score):
            yield self._rows_of(local, rows)

    def _rows_of(self, local: int, exported) -> ExportedRows:
        mine = exported.table_ids == local
        values = exported.values[mine]
        return ExportedRows(keys=exported.keys[mine],
                            embeddings=self.row_format.embeddings(values),
                            optimizer_states=self.row_format.states(values),
                            scores=exported.scores[mine])

    def import_rows(self, local: int, keys: torch.Tensor, embeddings: torch.Tensor,
                    optimizer_states: Optional[torch.Tensor],
                    scores: Optional[torch.Tensor]) -> None:
        """Inserts or overwrites rows (shapes checked by the caller); embeddings of
        another dtype are rounded to nearest into the rows' (``RowFormat.pack``); states
        default to the optimizer's initial state; ``scores`` are stored exactly, else
        the strategy scores the insert."""
        n = keys.numel()
        if optimizer_states is None:
            optimizer_states = torch.full((n, self.state_dim), float(self.init.initial_state))
        rows = self.row_format.pack(embeddings.to(self.device),
                                    optimizer_states.to(self.device, torch.float32)
                                    if self.state_dim else None)
        tids = torch.full((n,), local, dtype=torch.int64, device=self.device)
        if scores is not None:
            self.storage.import_rows(keys, tids, rows, scores.to(self.device, torch.int64),
                                     exact_scores=True)
        else:
            custom = self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED
            self.storage.import_rows(keys, tids, rows, self.custom_scores[tids] if custom else None)

    def clear_table(self, local: int) -> None:
        """Removes every row and admission counter of one table, in every tier."""
        self.storage.clear_table(local)
        if self.admission is not None:
            self.admission.clear_table(local)

    def clocks(self) -> TableClocks:
        """The group's optimizer step and score and admission clocks."""
        admission = 0 if self.admission is None else self.admission.counter.clock
        return TableClocks(self.update_count, self.table.clock, admission)

    def set_clocks(self, clocks: TableClocks) -> None:
        self.update_count = int(clocks.optimizer_step)
        self.table.set_clock(clocks.score_clock)
        if self.admission is not None:
            self.admission.counter.set_clock(clocks.admission_clock)

    def next_score(self, local: int) -> Optional[int]:
        """The score the next training batch gives a table's keys; None for scores
        that do not order rows by time (LFU, NO_EVICTION)."""
        strategy = self.score_strategy
        if strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
            return int(self.custom_scores[local])
        if strategy == DynamicEmbScoreStrategy.STEP:
            return self.train_steps + 1
        if strategy in (DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LRU_LFU):
            return self.table.clock + 1  # LRU_LFU: min_score reads the time part
        return None

    def expire(self) -> Optional[List[int]]:
        """TTL sweep in every tier: rows freed per local table; None without a ttl."""
        return None if self.table.ttl is None else self.storage.expire().tolist()

    def size(self, local: int) -> int:
        """Rows stored for one table (with a ttl: alive rows only)."""
        if (len(self.table_indices) == 1 and self.table.ttl is None
                and not self.storage.external.holds_rows):
            return self.table.size()
        return sum(int(rows.keys.numel()) for rows in self.export_chunks(local, 1 << 16, None))

    def describe(self) -> str:
        """The group's memory layout, in words."""
        return self.storage.describe()

    def metrics(self, local: int) -> TierMetrics:
        return self.storage.metrics[local]

    @property
    def layout(self):
        """The storage layout object (``dynamicemb.storage.layouts``)."""
        return self.storage.layout

    def flush(self) -> None:
        self.storage.flush()

    def release_graphs(self) -> None:
        self.storage.release_graphs()

    def reset_cache_states(self) -> None:
        self.storage.reset_cache_states()

    # ------------------------------------------------------------ kernels
    def _sources(self, lookup: GroupLookup):
        return self.storage.sources(lookup.transient, lookup.init)

    def forward(self, lookup: GroupLookup, offsets: Optional[torch.Tensor],
                weights: Optional[torch.Tensor], feature_col: torch.Tensor, batch: int,
                mean: bool, out: torch.Tensor, error: Optional[torch.Tensor] = None) -> None:
        """Writes this group's part of ``out``: pooled bags into its features' columns
        (``offsets`` given), or a row per lookup (sequence, ``offsets`` None).
        ``error``: the batch's input-check word (a refused batch reads zeros)."""
        sources = self._sources(lookup)
        if offsets is None:
            self.ops.sequence_forward(sources=sources, row_ref=lookup.row_ref,
                                      inverse=lookup.inverse, dim=self.dim, out=out,
                                      error=error)
        else:
            self.ops.pooled_forward(sources=sources, row_ref=lookup.row_ref,
                                    inverse=lookup.inverse, offsets=offsets, weights=weights,
                                    feature_col=feature_col, batch=batch, dim=self.dim,
                                    mean=mean, out=out, error=error)

    def clip(self, grad: torch.Tensor) -> torch.Tensor:
        """The output's gradient as this group's backward sees it: clamped elementwise
        to ``[-max_gradient, max_gradient]`` with ``gradient_clipping`` (FBGEMM's and
        upstream's rule), else ``grad`` itself."""
        opt = self.optimizer
        if not (self.training and opt.gradient_clipping):
            return grad
        return grad.clamp(-opt.max_gradient, opt.max_gradient)

    def weight_grad(self, lookup: GroupLookup, grad: torch.Tensor, offsets: torch.Tensor,
                    feature_col: torch.Tensor, batch: int, out: torch.Tensor,
                    error: Optional[torch.Tensor] = None) -> None:
        """out[j] = <row of lookup j, gradient of its bag> for this group's lookups
        (rows as they were in the forward: call before ``backward``)."""
        self.ops.per_sample_weight_grad(
            sources=self._sources(lookup), row_ref=lookup.row_ref,
            inverse=lookup.inverse, offsets=offsets, feature_col=feature_col, batch=batch,
            dim=self.dim, grad=grad, out=out, error=error)

    def backward(self, lookup: GroupLookup, grad: torch.Tensor, lr: float,
                 offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                 feature_col: torch.Tensor, batch: int, mean: bool,
                 error: torch.Tensor, sums: Optional[torch.Tensor] = None) -> int:
        """Sums each stored row's gradient and applies the fused optimizer (nothing
        for a batch whose input-check word ``error`` is set). The learning rate and
        Adam's step count are read in device memory, where the kernels advance the
        count. ``sums``: the rows' gradients as ``sum_gradients`` wrote them (the
        update then reads those).

        Returns:
            How many rows' summed gradients held NaN or inf and were left unchanged
            (``Backend.fused_backward``).
        """
        if not self.training:
            return 0
        lookup = self.refresh(lookup)
        opt = self.optimizer
        # the step size, bias correction and decay are computed from the learning
        # rate and Adam's step in device memory (``DeviceSchedule``)
        schedule = DeviceSchedule(self.device_lr(lr), self._optimizer_step.on_device(),
                                  advance=self._counts_updates,
                                  beta1=opt.beta1, beta2=opt.beta2,
                                  decoupled_decay=self._decoupled_decay())
        update = self._update(lr)
        rounding = None
        if self.row_format.dtype != torch.float32:  # the update count names the bits
            rounding = Rounding(lookup.keys, lookup.tids, self._rounding_spec, schedule.step,
                                self._stochastic)
        return self.ops.fused_backward(
            sources=self.storage.sources(self._no_transient), row_ref=lookup.row_ref,
            starts=lookup.starts, rank=lookup.rank, offsets=offsets, weights=weights,
            feature_col=feature_col, batch=batch, dim=self.dim, mean=mean, grad=grad,
            update=update, error=error, schedule=schedule, sums=sums, rounding=rounding)

    def _decoupled_decay(self) -> float:
        opt = self.optimizer
        return opt.weight_decay if opt.decay_mode == DynamicEmbWeightDecayMode.DECOUPLE else 0.0

    def _update(self, lr: float) -> OptimizerUpdate:
        """The optimizer's settings of a step at ``lr`` (Adam's scalars: the schedule's)."""
        opt = self.optimizer
        l2 = opt.weight_decay if opt.decay_mode == DynamicEmbWeightDecayMode.L2 else 0.0
        return OptimizerUpdate(optimizer=opt.optimizer, lr=lr, eps=opt.eps, beta1=opt.beta1,
                               beta2=opt.beta2, weight_decay=l2, step_size=lr,
                               bias_correction2_sqrt=1.0,
                               decay_scale=1.0 - lr * self._decoupled_decay())

    def step_rows(self, values: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """One step of the group's optimizer, in place, on rows a caller holds (not
        stored here): what a backward does to a stored row, by the same kernel, in
        float32 (a 16-bit group's stored rows would then be rounded).

        Args:
            values (Tensor): (n, dim + state_dim) float32 on the group's device, each
                row ``[embedding | optimizer state]``.
            grads (Tensor): (n, dim) float32, each row's summed gradient.
            lr: the learning rate.
        """
        if self.optimizer.optimizer == DynamicEmbOptimType.ADAM:
            raise ValueError("step_rows takes optimizers whose step does not count calls, not ADAM")
        update = self._update(lr)
        n = values.shape[0]
        each = torch.arange(n, dtype=torch.int64, device=self.device)  # a lookup a row
        self.ops.fused_backward(
            sources=RowSources(device=values, host=values[:0], transient=self._no_transient,
                               format=RowFormat(torch.float32, self.dim, self.state_dim)),
            row_ref=each, starts=torch.arange(n + 1, dtype=torch.int64, device=self.device),
            rank=each, offsets=None, weights=None,
            feature_col=torch.zeros(1, dtype=torch.int64, device=self.device), batch=n,
            dim=self.dim, mean=False, grad=grads, update=update)

    def sum_gradients(self, lookup: GroupLookup, grad: torch.Tensor,
                      offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                      feature_col: torch.Tensor, batch: int, mean: bool,
                      out: torch.Tensor) -> int:
        """The backward's first pass (a backend with free host reads): out (U, dim)
        = each unique row's summed gradient; returns how many hold NaN or inf."""
        return self.ops.sum_gradients(
            starts=lookup.starts, rank=lookup.rank, offsets=offsets, weights=weights,
            feature_col=feature_col, batch=batch, mean=mean, grad=grad, out=out)
