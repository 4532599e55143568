"""``BatchedDynamicEmbeddingTables``: many dynamic tables behind one TBE-style module.

The calling convention is FBGEMM's table-batched embedding: ``indices`` (all
lookups, feature-major) and ``offsets`` (``num_features * batch + 1`` bag
boundaries, bag ``f * batch + b``). The optimizer is fused into backward: there
is no separate ``step()``.
"""

import logging
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dynamicemb.embedding.fused_params import check_tbe_keywords, output_dtype_of, with_precision
from dynamicemb.embedding.group import TableGroup, group_key
from dynamicemb.embedding.records import ExportedCounters, ExportedRows, TableClocks
from dynamicemb.embedding.state import load_tables_state, tables_state
from dynamicemb.embedding.step import Step
from dynamicemb.embedding import upstream_members as upstream
from dynamicemb.ops import resolve_device
from dynamicemb.optimizer import DynamicEmbFusedOptimizer
from dynamicemb.storage import TierMetrics
from dynamicemb.options import (
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from dynamicemb.types import DynamicEmbGradientCheck, DynamicEmbScoreStrategy

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedCounters", "ExportedRows", "TableClocks"]

logger = logging.getLogger(__name__)


class BatchedDynamicEmbeddingTables(nn.Module):
    """Dynamic embedding tables (hash-table backed, raw int64 ids) batched in one module.

    Rows are created the first time a training forward sees an id (subject to
    admission); eval never inserts and never changes scores. Tables with equal
    physical options share one hash table (see ``docs/ARCHITECTURE.md``).

    Args:
        table_options: one ``DynamicEmbTableOptions`` per table.
        table_names: names for ``export_keys_values`` etc. (default ``t0, t1, …``).
        feature_table_map: table of each feature (default: one feature per table).
        pooling_mode: SUM, MEAN, or NONE (sequence; every table must share one dim).
        optimizer: fused optimizer (``DynamicEmbOptimType`` or FBGEMM's ``EmbOptimType``).
        learning_rate, eps, beta1, beta2, weight_decay, weight_decay_mode,
            initial_accumulator_value, gradient_clipping, max_gradient: its settings
            (``DynamicEmbOptimizerArgs``), unless a table's ``optimizer_args``
            overrides them.
        output_dtype: dtype of the output (float32, float16 or bfloat16; FBGEMM's
            ``SparseType`` too).
        device: where rows live (default CPU); each batch is moved there.
        sync_checks: on a GPU, raise for bad offsets in the call that gets them (one
            host sync per step). By default a training step that keeps its counts on
            the device checks them in a kernel: the bad batch's output is zeros, it
            changes no table, and the error is raised at the next call (see
            ``docs/ARCHITECTURE.md``, "Host synchronizations of a training step").
            The CPU always raises at once.
        gradient_check: what a NaN/inf gradient does on the CPU
            (``DynamicEmbGradientCheck`` or its value): ``"rows"`` (default) leaves
            the rows it reaches unchanged and updates the others, ``"batch"``
            refuses the whole batch's update; both raise ``ValueError`` in the
            backward. A GPU step does not check gradient values.
        **tbe_kwargs: other keywords of FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
            and upstream's ``BatchedDynamicEmbeddingTablesV2`` (``prefetch_pipeline``,
            ``max_norm``, ...): each is accepted where dynamic tables do what it asks and
            refused otherwise (``fused_params.py``); ``weights_precision`` (FP32, FP16,
            BF16) sets the tables' ``embedding_dtype``, ``stochastic_rounding=False``
            their rounding.

    Every argument after ``feature_table_map`` is keyword-only (upstream's positional
    order differs).

    Shape:
        forward(indices (N,), offsets (F * B + 1,), per_sample_weights (N,)) ->
        (B, sum of feature dims) for SUM/MEAN, (N, dim) for NONE.

    Example::

        tables = BatchedDynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=16, max_capacity=1 << 20)],
            optimizer=DynamicEmbOptimType.EXACT_SGD, learning_rate=0.1)
        out = tables(torch.tensor([3, 10**12, 3]), torch.tensor([0, 2, 3]))  # B=2
        out.sum().backward()  # rows 3 and 10**12 are updated in place
    """

    def __init__(
        self,
        table_options: Sequence[DynamicEmbTableOptions],
        table_names: Optional[Sequence[str]] = None,
        feature_table_map: Optional[Sequence[int]] = None,
        *,
        pooling_mode: DynamicEmbPoolingMode = DynamicEmbPoolingMode.SUM,
        optimizer=DynamicEmbOptimType.EXACT_SGD,
        learning_rate: float = 0.01,
        eps: float = 1e-8,
        beta1: float = 0.9,
        beta2: float = 0.999,
        weight_decay: float = 0.0,
        weight_decay_mode=None,
        initial_accumulator_value: float = 0.0,
        gradient_clipping: bool = False,
        max_gradient: float = 1.0,
        output_dtype=torch.float32,
        device: Optional[torch.device] = None,
        sync_checks: bool = False,
        gradient_check=DynamicEmbGradientCheck.ROWS,
        **tbe_kwargs,
    ) -> None:
        super().__init__()
        check_tbe_keywords(tbe_kwargs)
        module_optimizer = DynamicEmbOptimizerArgs(
            optimizer=optimizer, learning_rate=learning_rate, eps=eps, beta1=beta1,
            beta2=beta2, weight_decay=weight_decay, weight_decay_mode=weight_decay_mode,
            initial_accumulator_value=initial_accumulator_value,
            gradient_clipping=gradient_clipping, max_gradient=max_gradient,
        )
        self.output_dtype = output_dtype_of(output_dtype)
        try:
            gradient_check = DynamicEmbGradientCheck(gradient_check)
        except ValueError:
            raise ValueError(f"gradient_check must be one of "
                             f"{[c.value for c in DynamicEmbGradientCheck]}, got {gradient_check!r}"
                             ) from None
        self.table_options = list(table_options)
        num_tables = len(self.table_options)
        if num_tables == 0:
            raise ValueError("table_options must name at least one table")
        self.table_names = list(table_names) if table_names is not None else [
            f"t{i}" for i in range(num_tables)]
        if len(self.table_names) != num_tables or len(set(self.table_names)) != num_tables:
            raise ValueError("table_names must be unique, one per table")
        for name, options in zip(self.table_names, self.table_options):
            options.check_shape(name)
        self.table_options = [o.in_one_bucket() for o in with_precision(
            self.table_options, tbe_kwargs, self.table_names)]
        self.feature_table_map = list(feature_table_map) if feature_table_map is not None else list(
            range(num_tables))
        if not self.feature_table_map or not all(
                0 <= t < num_tables for t in self.feature_table_map):
            raise ValueError(f"feature_table_map entries must be in [0, {num_tables})")
        pooling = DynamicEmbPoolingMode(pooling_mode)
        self.dims = [o.dim for o in self.table_options]
        self.feature_dims = [self.dims[t] for t in self.feature_table_map]
        if pooling == DynamicEmbPoolingMode.NONE and len(set(self.feature_dims)) > 1:
            raise ValueError(f"pooling NONE needs one dim for all tables, got {sorted(set(self.dims))}")
        self.device = resolve_device(device if device is not None else "cpu")
        self._build_groups(module_optimizer)
        self._version = 0  # see content_version
        self._step = Step(self._groups, self.feature_table_map, self._table_location,
                          self.feature_dims, pooling, self.device, self.optimizer,
                          gradient_check, sync_checks, self._changed)

    def _build_groups(self, module_optimizer: DynamicEmbOptimizerArgs) -> None:
        by_key: Dict[tuple, List[int]] = {}
        for t, options in enumerate(self.table_options):
            opt = options.optimizer_args or module_optimizer
            by_key.setdefault(group_key(options, opt), []).append(t)
        self._groups: List[TableGroup] = []
        self._table_location = {}  # table -> (group, local id)
        for tables in by_key.values():
            options = [self.table_options[t] for t in tables]
            opt = options[0].optimizer_args or module_optimizer
            for local, t in enumerate(tables):
                self._table_location[t] = (len(self._groups), local)
            names = [self.table_names[t] for t in tables]
            self._groups.append(TableGroup(tables, names, options, opt, self.device))
        # One empty placeholder parameter per table: autograd reaches our backward
        # through it, the fused optimizer's param groups hold them, and TorchRec
        # registers them as "<table>.weight".
        self._table_params = nn.ParameterList(
            [nn.Parameter(torch.zeros(0, device=self.device)) for _ in self.table_names])
        self.optimizer = DynamicEmbFusedOptimizer(
            [
                ([self._table_params[t] for t in g.table_indices],
                 [self.table_names[t] for t in g.table_indices], g.optimizer)
                for g in self._groups
            ]
        )
        for g in self._groups:
            logger.info("dynamic tables %s: %s", [self.table_names[t] for t in g.table_indices],
                        g.describe())

    # -------------------------------------------------------------- public
    def named_parameters_by_table(self):
        """(table name, placeholder parameter) per table: empty tensors that stand for
        the tables (the rows live in hash tables), as TorchRec expects of a kernel."""
        yield from zip(self.table_names, self._table_params)

    def set_learning_rate(self, lr: float) -> None:
        """Sets the learning rate of every table (on a GPU, in device memory too: a
        captured CUDA graph's replays follow it)."""
        self.optimizer.set_learning_rate(lr)
        for g, group in enumerate(self._groups):
            group.device_lr(self.optimizer.param_groups[g]["lr"])


    @property
    def pooling_mode(self) -> DynamicEmbPoolingMode:
        """SUM, MEAN or NONE; settable (the same rows read another way)."""
        return self._step.pooling

    @pooling_mode.setter
    def pooling_mode(self, mode: DynamicEmbPoolingMode) -> None:
        self._step.pooling = DynamicEmbPoolingMode(mode)

    @property
    def gradient_check(self) -> DynamicEmbGradientCheck:
        """What a NaN/inf gradient does on the CPU (the constructor's argument)."""
        return self._step.gradient_check

    @property
    def train_steps(self) -> int:
        """Training forwards so far: the STEP strategy scores a batch's keys with
        ``train_steps + 1``."""
        return self._groups[0].train_steps

    def check_errors(self) -> None:
        """Raises the ``ValueError`` of a batch whose offsets a GPU kernel refused,
        waiting for the device (a sync): for use after replaying a CUDA graph of the
        step, where no module code runs (otherwise the next call raises it)."""
        self._step.errors.raise_if_refused(wait_for_device=True)

    def set_train_steps(self, steps: int) -> None:
        """Restores ``train_steps`` (e.g. from a checkpoint)."""
        if int(steps) < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self._changed()
        for g in self._groups:  # every group steps with the module
            g.train_steps = int(steps)


    def prefetch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
        *,
        frequencies: Optional[torch.Tensor] = None,
    ) -> None:
        """Looks up a coming batch now (dedup, hash-table work, rows fetched into the
        device tier, inserting in training). ``forward`` consumes prefetched batches in
        order and must be given the same ``indices``/``offsets``; results equal not
        prefetching (docs/ARCHITECTURE.md names the one exception). On CUDA a prefetch
        on a side stream is ordered after the last step's work and before the next."""
        self._step.prefetch(indices, offsets, per_sample_weights, frequencies, self.training)

    def flush(self) -> None:
        """Writes every device-tier row back to the host store."""
        for g in self._groups:
            g.flush()

    def release_graphs(self) -> None:
        """Declares that no CUDA graph captured over this module replays any more: its
        tables may grow again (a table a graph captured refuses to grow, since growth
        replaces the arrays the replays use). Capture again after the growth."""
        for g in self._groups:
            g.release_graphs()

    def reset_cache_states(self) -> None:
        """Flushes, then empties every device cache (the next batches start cold)."""
        for g in self._groups:
            g.reset_cache_states()

    def cache_metrics(self) -> Dict[str, TierMetrics]:
        """Per table: lookups, hits, misses, evictions, host rows read and written, rows
        expired (``ttl``: swept, or found expired by a lookup)."""
        return {name: group.metrics(local)
                for name, (group, local) in zip(self.table_names, map(self._location,
                                                                      self.table_names))}

    def print_cache_metrics(self) -> None:
        """Prints ``cache_metrics()`` and each group's memory layout."""
        for g in self._groups:
            print(f"{[self.table_names[t] for t in g.table_indices]}: {g.describe()}")
        for name, metrics in self.cache_metrics().items():
            print(f"  {name}: {metrics}")

    @property
    def content_version(self) -> int:
        """Counts the calls that changed rows, counters or clocks (training lookups and
        backwards, imports, clears, restores)."""
        return self._version

    def _changed(self) -> None:
        self._version += 1

    def get_extra_state(self) -> Dict[str, object]:
        """The tables' contents for ``state_dict()`` (key ``<prefix>_extra_state``):
        per table its keys, embeddings, optimizer states, scores, admission counters
        and clocks as CPU tensors, and ``train_steps``; device caches are flushed
        first. It holds one copy of every row (``docs/CHECKPOINTS.md``)."""
        return tables_state(self)

    def set_extra_state(self, state: Dict[str, object]) -> None:
        """Replaces every table's contents with a ``get_extra_state`` of a module
        with the same tables (names, dims, optimizer, score strategy).

        Raises:
            ValueError: naming what differs; no table has changed.
        """
        load_tables_state(self, state)

    def _location(self, table_name: str):
        if table_name not in self.table_names:
            raise KeyError(f"no table named {table_name!r}; tables: {self.table_names}")
        g, local = self._table_location[self.table_names.index(table_name)]
        return self._groups[g], local

    # ------------------------------------------------------------ per table
    def set_score(self, scores: Dict[str, int]) -> None:
        """Score given to the keys each named table touches from now on (CUSTOMIZED)."""
        for name, score in scores.items():
            group, local = self._location(name)
            if group.score_strategy != DynamicEmbScoreStrategy.CUSTOMIZED:
                raise ValueError(f"table {name!r} does not use the CUSTOMIZED score strategy")
            if int(score) < 0:
                raise ValueError(f"scores must be >= 0, got {score}")
            group.custom_scores[local] = int(score)

    def export_keys_values(
        self, table_name: str, device: Optional[torch.device] = None,
        batch_size: Optional[int] = None, *, min_score: Optional[int] = None,
    ) -> Union[ExportedRows, Tuple[torch.Tensor, torch.Tensor]]:
        """Every stored row of one table, or only those scoring at least ``min_score``
        (for large tables iterate with ``iter_keys_values``).

        Args:
            table_name: the table.
            device: upstream's form: return ``(keys, embeddings)`` on ``device``.
            batch_size: slots read at a time in upstream's form (default 65536).
            min_score: only rows scoring at least this.

        Returns:
            ``ExportedRows``, or ``(keys, embeddings)`` when ``device`` is given.

        Shape:
            keys: (n,) int64; embeddings: (n, dim) of the table's ``embedding_dtype``.
        """
        if device is None:
            if batch_size is not None:
                raise TypeError("batch_size belongs to upstream's form export_keys_values(name, "
                                "device, batch_size); pass device, or use iter_keys_values(name, "
                                "chunk_slots)")
            group, local = self._location(table_name)
            return group.export(local, min_score)
        batch_size = 65536 if batch_size is None else int(batch_size)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        device = torch.device(device)
        # the host store has at least one bucket: there is at least one chunk
        chunks = list(self.iter_keys_values(table_name, batch_size, min_score=min_score))
        return (torch.cat([c.keys for c in chunks]).to(device),
                torch.cat([c.embeddings for c in chunks]).to(device))

    def read_rows(self, table_name: str, keys: torch.Tensor, train: bool = True) -> torch.Tensor:
        """The current embeddings of ``keys`` in one table, changing nothing: a stored
        row from the tier holding it, else the initializer's row a training insert
        (``train``) or an eval lookup would read.

        Args:
            keys (Tensor): (n,) int64.
            train: an absent key's row is the training initializer's (else the eval's).

        Returns:
            (n, dim) float32 on the module's device (16-bit rows widened exactly).
        """
        group, local = self._location(table_name)
        return group.read_rows(local, self._keys(keys), train)

    def _keys(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.to(self.device, torch.int64).contiguous()

    def holds(self, table_name: str, keys: torch.Tensor) -> torch.Tensor:
        """(n,) bool on the module's device: whether a tier stores each of ``keys`` in
        one table (the external tier asked from the host), read without changing
        anything."""
        group, local = self._location(table_name)
        return group.holds(local, self._keys(keys))

    def read_optimizer_states(self, table_name: str, keys: torch.Tensor) -> torch.Tensor:
        """The optimizer states of ``keys`` in one table, changing nothing: a stored
        row's, else the optimizer's initial state (also for rows only below).

        Args and device: as ``read_rows``'s; returns (n, state_dim) float32.
        """
        group, local = self._location(table_name)
        return group.optimizer_states(local, self._keys(keys))

    def iter_keys_values(self, table_name: str, chunk_slots: int = 1 << 16, *,
                         min_score: Optional[int] = None) -> Iterator[ExportedRows]:
        """The stored rows of one table in chunks of at most ``chunk_slots`` rows (the
        host store's slots, then the external tier's rows). The table must not change
        while the iterator is used."""
        if chunk_slots <= 0:
            raise ValueError(f"chunk_slots must be positive, got {chunk_slots}")
        group, local = self._location(table_name)
        yield from group.export_chunks(local, chunk_slots, min_score)

    def import_keys_values(
        self,
        table_name: str,
        keys: torch.Tensor,
        embeddings: torch.Tensor,
        optimizer_states: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
    ) -> None:
        """Writes rows into one table (inserting or overwriting), e.g. to copy weights in.

        Args:
            keys (Tensor): (n,) int64.
            embeddings (Tensor): (n, dim) floating; rounded to nearest into 16-bit rows.
            optimizer_states (Tensor, optional): (n, state_dim); default: the
                optimizer's initial state.
            scores (Tensor, optional): (n,) int64 >= 0 stored exactly, whatever the
                score strategy (restoring ``export_keys_values``); default: the score
                the strategy gives an inserting call (CUSTOMIZED: ``set_score``'s).
        """
        group, local = self._location(table_name)
        self._changed()
        n = keys.numel()
        if embeddings.shape != (n, group.dim):
            raise ValueError(f"embeddings must have shape ({n}, {group.dim}), got {tuple(embeddings.shape)}")
        if optimizer_states is not None and optimizer_states.shape != (n, group.state_dim):
            raise ValueError(f"optimizer_states must have shape ({n}, {group.state_dim}), "
                             f"got {tuple(optimizer_states.shape)}")
        if scores is not None and scores.shape != (n,):
            raise ValueError(f"scores must have shape ({n},), got {tuple(scores.shape)}")
        group.import_rows(local, keys.to(self.device), embeddings, optimizer_states, scores)

    def clear_table(self, table_name: str) -> None:
        """Removes every row and admission counter of one table (both tiers); other
        tables, clocks and steps are unchanged. A load that replaces a table's
        contents starts here."""
        group, local = self._location(table_name)
        self._changed()
        group.clear_table(local)

    def optimizer_args(self, table_name: str) -> DynamicEmbOptimizerArgs:
        """The optimizer settings of one table (its own or the module's)."""
        return self._location(table_name)[0].optimizer

    def step_rows(self, table_name: str, values: torch.Tensor, grads: torch.Tensor) -> None:
        """One step of a table's optimizer kernel at the current learning rate, in
        place, on rows a caller holds (stale replicas' copies). Not for ADAM.

        Args:
            values (Tensor): (n, dim + optimizer_state_dim) float32, rows
                ``[embedding | state]``, on the module's device.
            grads (Tensor): (n, dim) float32, each row's summed gradient.
        """
        group, _ = self._location(table_name)
        g = self._groups.index(group)
        group.step_rows(values, grads, self.optimizer.param_groups[g]["lr"])

    def optimizer_state_dim(self, table_name: str) -> int:
        """Floats of optimizer state stored after the embedding in each row."""
        return self._location(table_name)[0].state_dim

    def table_clocks(self, table_name: str) -> TableClocks:
        """The optimizer step and score clocks of the table's physical group."""
        return self._location(table_name)[0].clocks()

    def set_table_clocks(self, table_name: str, clocks: TableClocks) -> None:
        """Restores ``table_clocks`` (every table of the group shares them)."""
        group, _ = self._location(table_name)
        if min(clocks) < 0:
            raise ValueError(f"clocks must be >= 0, got {clocks}")
        self._changed()
        group.set_clocks(clocks)

    def next_score(self, table_name: str) -> int:
        """The score the next training batch gives the keys it touches (LRU, LRU_LFU,
        STEP: rows scoring at least this were touched after this call; CUSTOMIZED: the
        score ``set_score`` registered)."""
        group, local = self._location(table_name)
        score = group.next_score(local)
        if score is not None:
            return score
        raise ValueError(
            f"table {table_name!r} uses {group.score_strategy.name} scores, which do not "
            f"order rows by time; next_score needs LRU, LRU_LFU, STEP or CUSTOMIZED")

    def expire(self) -> Dict[str, int]:
        """TTL sweep: frees, in every tier, the rows of tables with a ``ttl`` that
        were not looked up for more than ``ttl`` ticks (one kernel pass per group).
        Each rank sweeps its own rows: no collective.

        Returns:
            Rows freed per table name (tables with a ttl only); the running totals,
            with rows found expired by lookups, are ``cache_metrics()[name].expired``.
        """
        freed: Dict[str, int] = {}
        for group in self._groups:
            counts = group.expire()
            if counts is None:
                continue
            for local, index in enumerate(group.table_indices):
                freed[self.table_names[index]] = counts[local]
        return freed

    def export_admission_counters(self, table_name: str) -> ExportedCounters:
        """The admission counters of one table (empty without admission)."""
        group, local = self._location(table_name)
        if group.admission is None:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return ExportedCounters(empty, empty.double(), empty)
        entries = group.admission.export(local)
        return ExportedCounters(entries.keys, entries.values[:, 0], entries.scores)

    def import_admission_counters(self, table_name: str, keys: torch.Tensor,
                                  counts: torch.Tensor, scores: torch.Tensor) -> None:
        """Writes admission counters of one table with their saved scores.

        Args:
            keys (Tensor): (m,) int64.
            counts (Tensor): (m,) float64 occurrences counted.
            scores (Tensor): (m,) int64 >= 0.
        """
        group, local = self._location(table_name)
        if group.admission is None:
            raise ValueError(f"table {table_name!r} has no admission strategy")
        m = keys.numel()
        if counts.shape != (m,) or scores.shape != (m,):
            raise ValueError(f"counts and scores must have shape ({m},)")
        self._changed()
        group.admission.restore(local, keys.to(self.device), counts.to(self.device),
                                scores.to(self.device, torch.int64))

    def table_size(self, table_name: str) -> int:
        """Rows stored for one table (with a ``ttl``: alive rows, not those expired and
        waiting for a sweep)."""
        group, local = self._location(table_name)
        return group.size(local)

    # ------------------------------------------------------- upstream's members
    @property
    def tables(self) -> "upstream.StorageView":
        """Upstream's storage, as far as its tests read it: ``export_keys_values(device,
        batch_size, table_id)`` and ``size(table_id)`` (``upstream.storage_view``)."""
        return upstream.storage_view(self)

    @property
    def cache(self) -> Optional["upstream.CacheView"]:
        """Upstream's cache statistics of the cached tables, or None
        (``upstream.cache_view``)."""
        return upstream.cache_view(self)

    def set_record_cache_metrics(self, record: bool) -> None:
        """Upstream's switch of cache statistics: accepted; they are always counted
        here (``cache_metrics()``)."""
        if not isinstance(record, bool):
            raise ValueError(f"record must be a bool, got {type(record).__name__}")

    @property
    def _admission_counter(self):
        """Upstream's one admission ``Counter`` per module (``upstream.admission_counter``)."""
        return upstream.admission_counter(self._groups)

    def get_score(self) -> Dict[str, int]:
        """Upstream's per-table scores: ``next_score`` of each table.

        Raises:
            ValueError: a table's scores do not order rows by time (LFU, NO_EVICTION).
        """
        return {name: self.next_score(name) for name in self.table_names}

    def incremental_dump(self, named_thresholds=None, pg=None):
        """Upstream's module-level incremental dump (``upstream.incremental_dump``)."""
        return upstream.incremental_dump(self, named_thresholds, pg)

    # ------------------------------------------------------------- forward
    # torch.compile breaks the graph here: a lookup drives hash-table kernels that
    # change state (inserts, scores) and a fused backward, which Dynamo cannot trace.
    # Serving uses ``dynamicemb.inference``, whose lookup is a traceable custom op.
    @torch.compiler.disable
    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
        *,
        frequencies: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Looks up (and in training, inserts) rows and pools them per bag.

        Args:
            indices (Tensor): (N,) int32/int64 raw ids, feature-major.
            offsets (Tensor): (F * B + 1,) int32/int64, non-decreasing from 0 to N.
            per_sample_weights (Tensor, optional): (N,) float weights of the
                pooled sum (SUM pooling only).
            frequencies (Tensor, optional): (N,) int64 >= 1, how many occurrences
                each lookup stands for when ids were deduplicated upstream (LFU scores
                and admission count them); default 1.

        Returns:
            (B, sum of feature dims) for SUM/MEAN; (N, dim) for NONE.

        Raises:
            TypeError, ValueError: on bad input, before any table changes: ids or
                offsets of another dtype (int8/int16/uint*/bool/float), not 1-D, on
                the meta device, offsets that do not bound the ids, weights of
                another length or not finite. Non-contiguous tensors, and tensors on
                another device than the rows, are accepted (copied). The backward
                raises ``ValueError`` on a NaN/inf gradient and updates no row.
        """
        out = self._step.forward(indices, offsets, per_sample_weights, frequencies,
                                 self.training, self._table_params[0])
        return out if self.output_dtype == torch.float32 else out.to(self.output_dtype)
