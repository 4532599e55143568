"""A physical group of logical tables: one hash table, one optimizer, one dim.

``BatchedDynamicEmbeddingTables`` fuses the tables whose physical options agree
(dim, score strategy, bucket capacity, load factor, check mode, training flag,
optimizer settings, admission) into one ``TableGroup``: one dedup, one hash
table call and one fused backward per group and batch. The capacity of a group
is the sum of its tables' capacities, shared by them. The group is the only
caller of the embedding kernels.
"""

import math
from dataclasses import astuple
from typing import List, NamedTuple, Optional

import torch

from dynamicemb.embedding.admission import Admission
from dynamicemb.embedding.initialization import RowInitializer
from dynamicemb.ops import for_device
from dynamicemb.ops.interface import (BatchPart, DeviceSchedule, InitRows, OptimizerUpdate,
                                      num_buckets_for, optimizer_state_dim)
from dynamicemb.options import (DynamicEmbOptimizerArgs, DynamicEmbOptimType, DynamicEmbTableOptions,
                                DynamicEmbWeightDecayMode)
from dynamicemb.storage import TieredStorage
from dynamicemb.storage.external import ExternalStorageError, namespace_of, open_store
from dynamicemb.storage.external.tier import ExternalTier
from dynamicemb.table import MAX_TABLES, PendingInsert, ScoredHashTable
from dynamicemb.table.device_counts import DeviceCounters, capturing
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["Lookup", "TableGroup", "group_key"]


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
                  table_names: List[str]) -> Optional[ExternalTier]:
    """The external tier of a group whose first table's ``options`` name a store."""
    if options.external_storage is None:
        return None
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
    try:
        store = open_store(options.external_storage, namespace_of(table_names, rank),
                           host.value_dim)
    except ExternalStorageError as e:  # locked, unreachable, or another module's rows
        raise ExternalStorageError(f"{e} (tables {table_names})") from e
    return ExternalTier(store, host, str(table_names))


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


class Lookup(NamedTuple):
    """One group's lookup of a batch, from its first phase to its backward.

    Built by field name. ``begin_lookup`` fills the dedup and, in training, the
    prepared ``insert``; ``finish_lookup`` the row references and transient rows.

    Shape:
        keys, tids: (U,) unique (key, local table id) pairs; inverse: (N,) unique
        index of each lookup (-1: a lookup of another group); counts: (U,)
        occurrences in the batch; starts (U + 1,) and rank (N,): the lookups grouped
        by unique row for the backward (rank -1: another group's lookup), None when
        the lookup does not train; row_ref: (U,) where each unique row lives
        (``dynamicemb.storage``; -(t + 1) for row t of ``transient``, [T, dim]);
        generation: the storage's when looked up; insert: the prepared insert until
        it is committed; admitted: (U,) bool (padded: (N,), the keys the insert
        took), None without admission.

        A padded lookup (``TableGroup.counts_on_device``) has N entries where others
        have U: the unique rows, then padding (no lookup, reference -1); ``init``
        gives the kernels the initializers that compute the rows of negative
        references (keys whose insert failed), so it has no transient rows.
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
    insert: Optional[PendingInsert] = None
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
        self.init = RowInitializer(self.ops, table_names, options, self.dim, optimizer,
                                   self.state_dim)
        row_bytes = (self.dim + self.state_dim) * 4
        host_rows = host_budget_rows(options, row_bytes, table_names)
        device_rows = device_budget_rows(options, row_bytes, table_names)
        self.table = ScoredHashTable(  # the host store: index of record
            num_tables=len(table_indices),
            capacity=min(sum(o.init_capacity or o.max_capacity for o in options), host_rows),
            max_capacity=host_rows,
            bucket_capacity=first.bucket_capacity,
            score_strategy=first.score_strategy,
            max_load_factor=first.max_load_factor,
            value_dim=self.dim + self.state_dim,
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
            self.table, first.caching, device_rows, device=device, initialize=self.init.stored,
            external=external_tier(first, self.table, table_names),
            initialize_new=self.init.stored_new)
        self.admission = (None if first.admit_strategy is None
                          else Admission(first.admit_strategy,
                                         [o.admission_counter for o in options], device))
        # On the rows' device: indexed by each batch's table ids.
        self.custom_scores = torch.zeros(len(table_indices), dtype=torch.int64, device=device)
        # Adam's step count: set on the host, advanced in device memory by a backward
        # of a step counted on the device (its learning rate is read there too)
        self._optimizer_step = DeviceCounters([0], device)
        self._lr: Optional[torch.Tensor] = None
        self._lr_written: Optional[float] = None
        self._no_transient = torch.empty(0, self.dim, dtype=torch.float32, device=device)

    @property
    def adam_step(self) -> int:
        """Backward passes Adam applied (its bias correction; 0 for other optimizers)."""
        return self._optimizer_step.value(0)

    @adam_step.setter
    def adam_step(self, value: int) -> None:
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
    def counts_on_device(self, insert: bool) -> bool:
        """Whether a lookup (training when ``insert``) may run with every size and count
        left on the device: a training lookup whose storage allows it
        (``TieredStorage.counts_on_device``; CUSTOMIZED scores are read by the
        kernels from ``custom_scores``, admission decides on the device too), or an
        eval lookup whose storage finds rows on the device
        (``TieredStorage.finds_on_device``). Then ``begin_lookup`` takes the
        module's error word."""
        if not (insert and self.training):
            return self.storage.finds_on_device
        return (self.storage.counts_on_device
                # keys not admitted read spec rows T + t (int16 table ids)
                and (self.admission is None or 2 * len(self.table_indices) <= MAX_TABLES + 1))

    def begin_lookup(self, keys: torch.Tensor, tids: torch.Tensor, insert: bool,
                     frequencies: Optional[torch.Tensor] = None,
                     error: Optional[torch.Tensor] = None,
                     part: Optional[BatchPart] = None) -> Lookup:
        """Phase one of a lookup: dedup, admission decision, hash-table slots decided.

        Nothing observable changes until ``finish_lookup``; ``abort_lookup`` undoes
        the prepared insert, so a module can make a batch over several groups atomic.

        Args:
            keys (Tensor): (N,) int64 ids of this group's lookups.
            tids (Tensor): (N,) int16 local table ids.
            insert: training: insert admitted unseen keys; else only find.
            frequencies (Tensor, optional): (N,) int64 occurrences each lookup stands
                for (ids deduplicated upstream); default 1.
            error (Tensor, optional): (1,) int64, the module's input-check word of this
                batch: given only where ``counts_on_device(insert)``, and then the
                lookup is padded (nothing read on the host) and a batch whose word is
                set changes nothing.
            part (``BatchPart``, optional): with ``error``, keys, tids and
                frequencies are the whole batch, of which this group takes its part
                (other groups' lookups get inverse -1); otherwise the group's own.
        """
        train = insert and self.training
        if error is not None and not train:  # eval, padded: rows found, none inserted
            unique = self.ops.padded_dedup(keys=keys, table_ids=tids, error=error, part=part)
            lookup = Lookup(keys=unique.keys, tids=unique.table_ids, inverse=unique.inverse,
                            counts=unique.counts,
                            row_ref=self.storage.resolve(unique.keys, unique.table_ids))
            if self.storage.external is not None:  # absent rows may be below: read as
                return lookup  # transient rows by finish_lookup, from the host
            return lookup._replace(init=InitRows(unique.keys, unique.table_ids,
                                                 self.init.spec(False, self.device)))
        customized = self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED
        table_scores = self.custom_scores if customized else None
        if error is not None:
            unique, pending = self.storage.prepare_dedup(
                keys, tids, frequencies, padded=True, error=error, part=part,
                admit=None if self.admission is None else self._admit,
                table_scores=table_scores)
            return Lookup(keys=unique.keys, tids=unique.table_ids, inverse=unique.inverse,
                          counts=unique.counts, starts=unique.starts, rank=unique.rank,
                          insert=pending, admitted=pending.padded.admitted,
                          init=self._computed_rows(unique, pending.padded.admitted))
        if train and self.admission is None:
            # Nothing to decide between the dedup and the insert: one call.
            unique, pending = self.storage.prepare_dedup(keys, tids, frequencies,
                                                         table_scores=table_scores)
            return Lookup(keys=unique.keys, tids=unique.table_ids, inverse=unique.inverse,
                          counts=unique.counts, starts=unique.starts, rank=unique.rank,
                          insert=pending)
        unique = self.ops.dedup(keys=keys, table_ids=tids, frequencies=frequencies, group=train)
        lookup = Lookup(keys=unique.keys, tids=unique.table_ids, inverse=unique.inverse,
                        counts=unique.counts, starts=unique.starts, rank=unique.rank)
        if not train:
            return lookup._replace(row_ref=self.storage.resolve(lookup.keys, lookup.tids))
        keys_in, tids_in, counts_in, admitted = lookup.keys, lookup.tids, lookup.counts, None
        if self.admission is not None:
            # The table indexes every key in its tiers; a row expired at the insert's
            # time is absent.
            stored = self.storage.contains(keys_in, tids_in, at_time=self.table.next_time)
            admitted = self.admission.admitted(stored, keys_in, tids_in, counts_in)
            keys_in, tids_in, counts_in = keys_in[admitted], tids_in[admitted], counts_in[admitted]
        scores = None
        if customized:
            scores = self.custom_scores[tids_in.long()]
        elif self.score_strategy in (DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.LRU_LFU):
            scores = counts_in  # LFU counts occurrences, not batches
        return lookup._replace(insert=self.storage.prepare(keys_in, tids_in, scores),
                               admitted=admitted)

    def _admit(self, unique, stored: torch.Tensor) -> torch.Tensor:
        """The admission of a padded lookup's unique keys (``stored``: in the host
        store; a key an external tier holds is stored too)."""
        stored = self.storage.or_below(unique.keys, unique.table_ids, stored, unique.counts > 0)
        return self.admission.admitted(stored, unique.keys, unique.table_ids, unique.counts)

    def _computed_rows(self, unique, admitted: Optional[torch.Tensor]) -> InitRows:
        """The initializers of a padded training lookup's rows without a slot: the
        tables' (a failed insert), and for keys not admitted the admission's
        initializer where it has one (table id T + t of the spec)."""
        args = None if self.admission is None else self.admission.initializer_args
        if args is None:
            return InitRows(unique.keys, unique.table_ids, self.init.spec(True, self.device))
        waiting = (unique.counts > 0) & ~admitted
        tids = torch.where(waiting, unique.table_ids + len(self.table_indices),
                           unique.table_ids)
        return InitRows(unique.keys, tids, self.init.spec(True, self.device, others=args))

    def abort_lookup(self, lookup: Lookup) -> None:
        if lookup.insert is not None:
            lookup.insert.abort()

    def finish_lookup(self, lookup: Lookup) -> Lookup:
        """Phase two: commit the insert (storage initializes new rows), place rows in
        their tiers, count admissions. Unique keys without a stored row get transient
        rows."""
        keys, tids = lookup.keys, lookup.tids
        if lookup.init is not None:  # padded: rows of absent keys are computed where read
            refs = lookup.row_ref
            if lookup.insert is not None:
                status = lookup.insert.upserted.status
                refs = self.storage.commit_padded(lookup.insert, keys, tids, lookup.counts)
                if lookup.admitted is not None:
                    self.admission.count_on_device(keys, tids, lookup.counts, lookup.admitted,
                                                   status)
            return lookup._replace(row_ref=refs, transient=self._no_transient,
                                   generation=self.storage.generation, insert=None)
        if lookup.insert is None:
            refs = lookup.row_ref
        elif lookup.admitted is None:  # every unique key went to the host store
            result = self.storage.commit(lookup.insert, keys, tids)
            refs = self.storage.place(keys, tids, result.slots, result.inserted, lookup.counts,
                                      num_stored=keys.numel() - result.num_failed)
            if result.num_failed == 0:  # every row stored: no transient rows
                return lookup._replace(row_ref=refs, transient=self._no_transient,
                                       generation=self.storage.generation, insert=None)
        else:
            at = lookup.admitted.nonzero().squeeze(1)
            result = self.storage.commit(lookup.insert, keys[at], tids[at])
            new_at = result.inserted_positions().to(self.device)
            host_slots = torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
            host_slots[at] = result.slots.to(self.device)
            new = torch.zeros_like(lookup.admitted)
            new[at[new_at]] = True
            refs = self.storage.place(keys, tids, host_slots, new, lookup.counts)
            self.admission.count(keys, tids, lookup.counts, lookup.admitted, at[new_at])
        transient = self._transient_rows(keys, tids, refs, train=lookup.insert is not None,
                                         rejected=lookup.admitted)
        return lookup._replace(row_ref=refs, transient=transient,
                               generation=self.storage.generation, insert=None)

    def _transient_rows(self, keys, tids, refs, train: bool,
                        rejected: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Initialized rows for unique keys without a stored row (refs < 0); their
        references become -(t + 1) for transient row t. Keys not admitted (``rejected``
        False, given with admission) get the admission strategy's initializer if it
        has one."""
        if refs.numel() == 0 or int(refs.min()) >= 0:  # every row stored (the common case)
            return self._no_transient
        missing = (refs < 0).nonzero().squeeze(1)
        refs[missing] = -(torch.arange(missing.numel(), dtype=torch.int64, device=self.device) + 1)
        rows = self.init.transient(keys[missing], tids[missing], train)
        if not train:  # rows of the external tier are read where they are
            self.storage.fill_from_below(keys[missing], tids[missing], rows)
        args = None if self.admission is None else self.admission.initializer_args
        if train and rejected is not None and args is not None:
            waiting = (~rejected[missing]).nonzero().squeeze(1)
            if waiting.numel():
                rows[waiting] = self.init.transient(keys[missing][waiting],
                                                    tids[missing][waiting], train, args=args)
        return rows

    def refresh(self, lookup: Lookup) -> Lookup:
        """The lookup with its row references found again if rows moved since (growth,
        promotion, eviction); rows that left the table get no update in backward."""
        if lookup.generation == self.storage.generation:
            return lookup
        if lookup.init is not None:  # padded: a row that left reads its initializer's
            found = self.storage.resolve(lookup.keys, lookup.tids)
            refs = torch.where(lookup.row_ref >= 0, found, lookup.row_ref)
            return lookup._replace(row_ref=refs, generation=self.storage.generation)
        refs = lookup.row_ref.clone()
        stored = (refs >= 0).nonzero().squeeze(1)
        found = self.storage.resolve(lookup.keys[stored], lookup.tids[stored])
        gone = found < 0
        if bool(gone.any()):  # keep reading something defined: the initializer's row
            extra = self.init.transient(lookup.keys[stored][gone], lookup.tids[stored][gone],
                                        train=True)
            found[gone] = -(torch.arange(extra.shape[0], dtype=torch.int64, device=self.device)
                            + lookup.transient.shape[0] + 1)
            lookup = lookup._replace(transient=torch.cat([lookup.transient, extra]))
        refs[stored] = found
        return lookup._replace(row_ref=refs, generation=self.storage.generation)

    # ------------------------------------------------------------ kernels
    def _sources(self, lookup: Lookup):
        return self.storage.sources(lookup.transient, lookup.init)

    def forward(self, lookup: Lookup, offsets: Optional[torch.Tensor],
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

    def weight_grad(self, lookup: Lookup, grad: torch.Tensor, offsets: torch.Tensor,
                    feature_col: torch.Tensor, batch: int, out: torch.Tensor,
                    error: Optional[torch.Tensor] = None) -> None:
        """out[j] = <row of lookup j, gradient of its bag> for this group's lookups
        (rows as they were in the forward: call before ``backward``)."""
        self.ops.per_sample_weight_grad(
            sources=self._sources(lookup), row_ref=lookup.row_ref,
            inverse=lookup.inverse, offsets=offsets, feature_col=feature_col, batch=batch,
            dim=self.dim, grad=grad, out=out, error=error)

    def backward(self, lookup: Lookup, grad: torch.Tensor, lr: float,
                 offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                 feature_col: torch.Tensor, batch: int, mean: bool,
                 error: Optional[torch.Tensor] = None,
                 sums: Optional[torch.Tensor] = None) -> int:
        """Sums each stored row's gradient and applies the fused optimizer (nothing
        for a batch whose input-check word ``error`` is set). With ``error`` (a step
        counted on the device) the learning rate and Adam's step count are read in
        device memory, where the kernels advance the count. ``sums``: the rows'
        gradients as ``sum_gradients`` wrote them (the update then reads those).

        Returns:
            How many rows' summed gradients held NaN or inf and were left unchanged
            (``Backend.fused_backward``).
        """
        if not self.training:
            return 0
        lookup = self.refresh(lookup)
        opt = self.optimizer
        adam = opt.optimizer == DynamicEmbOptimType.ADAM
        mode = opt.decay_mode
        decoupled = opt.weight_decay if mode == DynamicEmbWeightDecayMode.DECOUPLE else 0.0
        step_size, bias2_sqrt, schedule = lr, 1.0, None
        if error is not None:
            schedule = DeviceSchedule(self.device_lr(lr), self._optimizer_step.on_device(),
                                      advance=adam, beta1=opt.beta1, beta2=opt.beta2,
                                      decoupled_decay=decoupled)
        elif adam:
            self.adam_step += 1
            step_size = lr / (1 - opt.beta1 ** self.adam_step)
            bias2_sqrt = math.sqrt(1 - opt.beta2 ** self.adam_step)
        update = OptimizerUpdate(
            optimizer=opt.optimizer, lr=lr, eps=opt.eps, beta1=opt.beta1, beta2=opt.beta2,
            weight_decay=opt.weight_decay if mode == DynamicEmbWeightDecayMode.L2 else 0.0,
            step_size=step_size, bias_correction2_sqrt=bias2_sqrt,
            decay_scale=1.0 - lr * decoupled)
        return self.ops.fused_backward(
            sources=self.storage.sources(self._no_transient), row_ref=lookup.row_ref,
            starts=lookup.starts, rank=lookup.rank, offsets=offsets, weights=weights,
            feature_col=feature_col, batch=batch, dim=self.dim, mean=mean, grad=grad,
            update=update, error=error, schedule=schedule, sums=sums)

    def sum_gradients(self, lookup: Lookup, grad: torch.Tensor,
                      offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                      feature_col: torch.Tensor, batch: int, mean: bool,
                      out: torch.Tensor) -> int:
        """The backward's first pass (a backend with free host reads): out (U, dim)
        = each unique row's summed gradient; returns how many hold NaN or inf."""
        return self.ops.sum_gradients(
            starts=lookup.starts, rank=lookup.rank, offsets=offsets, weights=weights,
            feature_col=feature_col, batch=batch, mean=mean, grad=grad, out=out)
