"""``BatchedDynamicEmbeddingTables``: many dynamic tables behind one TBE-style module.

The calling convention is FBGEMM's table-batched embedding: ``indices`` (all
lookups, feature-major) and ``offsets`` (``num_features * batch + 1`` bag
boundaries, bag ``f * batch + b``). The optimizer is fused into backward: there
is no separate ``step()``.
"""

import logging
from collections import deque
from typing import Deque, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dynamicemb.embedding.buffers import OutputBuffers, Scratch
from dynamicemb.embedding.fused_params import check_tbe_keywords, output_dtype_of
from dynamicemb.embedding.group import Lookup, TableGroup, group_key
from dynamicemb.embedding.input_errors import CheckedBatch, InputErrors, offsets_message
from dynamicemb.embedding.state import load_tables_state, tables_state
from dynamicemb.embedding.streams import StreamOrder
from dynamicemb.embedding.upstream_members import UpstreamMembers
from dynamicemb.ops import for_device, resolve_device
from dynamicemb.ops.interface import BatchPart
from dynamicemb.optimizer import DynamicEmbFusedOptimizer
from dynamicemb.storage import TierMetrics
from dynamicemb.table.checks import check_batch_types, check_frequencies
from dynamicemb.table.shared_zeros import SharedZeros
from dynamicemb.options import (
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedCounters", "ExportedRows", "TableClocks"]

logger = logging.getLogger(__name__)


class ExportedRows(NamedTuple):
    """A logical table's stored rows (``export_keys_values``).

    Shape:
        keys: (n,) int64; embeddings: (n, dim); optimizer_states: (n, state_dim);
        scores: (n,) int64.
    """

    keys: torch.Tensor
    embeddings: torch.Tensor
    optimizer_states: torch.Tensor
    scores: torch.Tensor


class ExportedCounters(NamedTuple):
    """A logical table's admission counters (keys seen but not admitted yet).

    Shape:
        keys: (m,) int64; counts: (m,) float64 occurrences counted; scores: (m,)
        int64 the counters' LRU scores (which counter is forgotten first).
    """

    keys: torch.Tensor
    counts: torch.Tensor
    scores: torch.Tensor


class TableClocks(NamedTuple):
    """The counters training depends on besides the rows, per physical group (tables
    sharing a group share them; see ``BatchedDynamicEmbeddingTables.table_clocks``).

    Attributes:
        optimizer_step: backward passes the group's optimizer applied (Adam's bias
            correction; 0 for the other optimizers).
        score_clock: the host store's clock (the LRU score of the latest inserting
            call).
        admission_clock: the admission counters' clock (0 without admission).
    """

    optimizer_step: int
    score_clock: int
    admission_clock: int


class _Batch(NamedTuple):
    """A validated batch and what each group looked up for it."""

    offsets: torch.Tensor  # (F * B + 1,) int64
    weights: Optional[torch.Tensor]  # (N,) float32
    batch_size: int
    num_indices: int  # N
    lookups: List[Lookup]
    error: Optional[torch.Tensor] = None  # the check's word, where checked on the device
    check: Optional[CheckedBatch] = None


def _all_finite(t: torch.Tensor) -> bool:
    """Whether a float32 tensor holds no NaN/inf: one float64 sum (NaN and inf
    propagate through it; float32 values cannot overflow a float64 sum), 4x cheaper
    than ``isfinite(t).all()`` on a 1M-float gradient (0.8 against 3.5 ms, 1 thread)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64)))


def _check_has_data(t: torch.Tensor, name: str) -> None:
    """Raises for a tensor without data (the meta device): it cannot be moved to the rows."""
    if t.device.type == "meta":
        raise ValueError(f"{name} are on the meta device, which holds no data")


class _Prefetched(NamedTuple):
    indices: torch.Tensor
    offsets: torch.Tensor
    training: bool
    lookups: List[Lookup]
    check: Optional[CheckedBatch] = None  # its check on the device, if any


class _LookupFunction(torch.autograd.Function):
    """Autograd node whose backward runs the fused optimizer.

    The placeholder parameter makes autograd reach this node; the only gradient
    returned is that of ``per_sample_weights`` when they require one.
    """

    @staticmethod
    def forward(ctx, placeholder, weights, module, batch):  # noqa: D102
        ctx.module, ctx.batch = module, batch
        ctx.weights_device = None if weights is None else weights.device
        return module._compute_output(batch)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        grad_weights = ctx.module._apply_gradients(
            ctx.batch, grad_output, want_weight_grad=ctx.needs_input_grad[1])
        if grad_weights is not None:  # autograd wants it where the caller's weights are
            grad_weights = grad_weights.to(ctx.weights_device)
        return None, grad_weights, None, None


class BatchedDynamicEmbeddingTables(UpstreamMembers, nn.Module):
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
        **tbe_kwargs: other keywords of FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``
            and upstream's ``BatchedDynamicEmbeddingTablesV2`` (``prefetch_pipeline``,
            ``stochastic_rounding``, ``max_norm``, ...): each is accepted where dynamic
            tables do what it asks and refused otherwise (``fused_params.py``).

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
        self.table_options = [o.in_one_bucket() for o in self.table_options]
        self.feature_table_map = list(feature_table_map) if feature_table_map is not None else list(
            range(num_tables))
        if not self.feature_table_map or not all(
                0 <= t < num_tables for t in self.feature_table_map):
            raise ValueError(f"feature_table_map entries must be in [0, {num_tables})")
        self.pooling_mode = DynamicEmbPoolingMode(pooling_mode)
        self.dims = [o.dim for o in self.table_options]
        self.feature_dims = [self.dims[t] for t in self.feature_table_map]
        if self.pooling_mode == DynamicEmbPoolingMode.NONE and len(set(self.feature_dims)) > 1:
            raise ValueError(f"pooling NONE needs one dim for all tables, got {sorted(set(self.dims))}")
        self.device = resolve_device(device if device is not None else "cpu")
        self._build_groups(module_optimizer)
        self._train_steps = 0
        # counted steps advance the group table's step in device memory: then that
        # step is the module's (a STEP score is train_steps + 1 in both ways)
        self._steps_on_table = False
        self._version = 0  # see content_version
        self._prefetched: Deque[_Prefetched] = deque()
        self._outputs = OutputBuffers()
        self._grad_sums = Scratch()  # the backward's per-row gradient sums (CPU)
        self._stream_order = StreamOrder(self.device)
        self._zero_tids = SharedZeros(torch.int16, self.device)  # a one-table module's
        # Checks of a batch's values (finite weights and gradients) where they cost no
        # host sync: on the CPU; on a GPU a step does not wait for them.
        self._check_data = for_device(self.device).free_host_reads
        # On a backend that counts on the device, a step that keeps its counts there
        # checks its offsets into this word (read by the host at the next call).
        self._errors = (InputErrors(self.device, at_once=sync_checks)
                        if for_device(self.device).counts_on_device else None)

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
        num_features = len(self.feature_table_map)
        group_of = [self._table_location[t][0] for t in self.feature_table_map]
        # On the rows' device: they index per-lookup tensors and go to the kernels.
        self._feature_group = torch.tensor(group_of, dtype=torch.int64, device=self.device)
        self._feature_local_tid = torch.tensor(
            [self._table_location[t][1] for t in self.feature_table_map], dtype=torch.int16,
            device=self.device)
        cols = torch.tensor([0] + self.feature_dims, dtype=torch.int64,
                            device=self.device).cumsum(0)[:-1]
        self._feature_col = [
            torch.where(self._feature_group == g, cols, torch.full_like(cols, -1))
            for g in range(len(self._groups))
        ]
        self._num_features = num_features
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
                        g.storage.describe())

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
        """Every stored row of one table, or only those scoring at least ``min_score``.

        Called with a ``device`` (upstream's form, ``keys, embeddings =
        export_keys_values(name, device, batch_size=65536)``), it returns the keys and
        embeddings on ``device``, read ``batch_size`` host-store slots at a time.
        Without one it returns ``ExportedRows`` (keys, embeddings, optimizer states and
        scores, where the rows live); for large tables iterate with
        ``iter_keys_values``.

        Args:
            table_name: the table.
            device: where upstream's ``(keys, embeddings)`` are returned.
            batch_size: slots read at a time in upstream's form (default 65536).
            min_score: only rows scoring at least this.

        Returns:
            ``ExportedRows``, or ``(keys, embeddings)`` when ``device`` is given.

        Shape:
            keys: (n,) int64; embeddings: (n, dim) float32.
        """
        if device is None:
            if batch_size is not None:
                raise TypeError("batch_size belongs to upstream's form export_keys_values(name, "
                                "device, batch_size); pass device, or use iter_keys_values(name, "
                                "chunk_slots)")
            group, local = self._location(table_name)
            if group.storage.external is not None:  # every tier's rows
                return self._cat_rows(list(self.iter_keys_values(table_name,
                                                                 min_score=min_score)))
            return self._rows_of(group, local, group.storage.export(min_score=min_score))
        batch_size = 65536 if batch_size is None else int(batch_size)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        device = torch.device(device)
        # the host store has at least one bucket: there is at least one chunk
        chunks = list(self.iter_keys_values(table_name, batch_size, min_score=min_score))
        return (torch.cat([c.keys for c in chunks]).to(device),
                torch.cat([c.embeddings for c in chunks]).to(device))

    def iter_keys_values(self, table_name: str, chunk_slots: int = 1 << 16, *,
                         min_score: Optional[int] = None) -> Iterator[ExportedRows]:
        """The stored rows of one table, ``chunk_slots`` host-store slots at a time, then
        the external tier's rows (if any) ``chunk_slots`` rows at a time
        (each chunk holds at most that many rows: bounded memory for any table size).
        The table must not change while the iterator is used."""
        if chunk_slots <= 0:
            raise ValueError(f"chunk_slots must be positive, got {chunk_slots}")
        group, local = self._location(table_name)
        for rows in group.storage.export_chunks(chunk_slots, min_score):
            yield self._rows_of(group, local, rows)

    @staticmethod
    def _cat_rows(chunks: List[ExportedRows]) -> ExportedRows:
        return ExportedRows(*(torch.cat([getattr(c, f) for c in chunks])
                              for f in ExportedRows._fields))

    @staticmethod
    def _rows_of(group: TableGroup, local: int, exported) -> ExportedRows:
        mine = exported.table_ids == local
        values = exported.values[mine]
        return ExportedRows(
            keys=exported.keys[mine],
            embeddings=values[:, :group.dim],
            optimizer_states=values[:, group.dim:],
            scores=exported.scores[mine],
        )

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
            embeddings (Tensor): (n, dim) float32.
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
        keys = keys.to(self.device)
        rows = torch.zeros(n, group.dim + group.state_dim, dtype=torch.float32, device=self.device)
        rows[:, :group.dim] = embeddings
        if optimizer_states is not None:
            if optimizer_states.shape != (n, group.state_dim):
                raise ValueError(
                    f"optimizer_states must have shape ({n}, {group.state_dim}), "
                    f"got {tuple(optimizer_states.shape)}")
            rows[:, group.dim:] = optimizer_states
        elif group.optimizer.optimizer in (DynamicEmbOptimType.EXACT_ADAGRAD,
                                           DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD):
            rows[:, group.dim:] = group.optimizer.initial_accumulator_value
        tids = torch.full((n,), local, dtype=torch.int64, device=self.device)
        if scores is not None:
            if scores.shape != (n,):
                raise ValueError(f"scores must have shape ({n},), got {tuple(scores.shape)}")
            group.storage.import_rows(keys, tids, rows, scores.to(self.device, torch.int64),
                                      exact_scores=True)
            return
        if group.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
            scores = group.custom_scores[tids]
        group.storage.import_rows(keys, tids, rows, scores)

    def clear_table(self, table_name: str) -> None:
        """Removes every row and admission counter of one table (both tiers); other
        tables, clocks and steps are unchanged. A load that replaces a table's
        contents starts here."""
        group, local = self._location(table_name)
        self._changed()
        group.storage.clear_table(local)
        if group.admission is not None:
            group.admission.clear_table(local)

    def optimizer_args(self, table_name: str) -> DynamicEmbOptimizerArgs:
        """The optimizer settings of one table (its own or the module's)."""
        return self._location(table_name)[0].optimizer

    def optimizer_state_dim(self, table_name: str) -> int:
        """Floats of optimizer state stored after the embedding in each row."""
        return self._location(table_name)[0].state_dim

    def table_clocks(self, table_name: str) -> TableClocks:
        """The optimizer step and score clocks of the table's physical group."""
        group, _ = self._location(table_name)
        admission = 0 if group.admission is None else group.admission.counter.clock
        return TableClocks(group.adam_step, group.table.clock, admission)

    def set_table_clocks(self, table_name: str, clocks: TableClocks) -> None:
        """Restores ``table_clocks`` (every table of the group shares them)."""
        group, _ = self._location(table_name)
        if min(clocks) < 0:
            raise ValueError(f"clocks must be >= 0, got {clocks}")
        self._changed()
        group.adam_step = int(clocks.optimizer_step)
        group.table.set_clock(clocks.score_clock)
        if group.admission is not None:
            group.admission.counter.set_clock(clocks.admission_clock)

    @property
    def train_steps(self) -> int:
        """Training forwards so far: the STEP strategy scores a batch's keys with
        ``train_steps + 1``."""
        return self._groups[0].table.step if self._steps_on_table else self._train_steps

    def _steps_to_host(self) -> None:
        """After counted steps, the host's train steps again (read from the device)."""
        if self._steps_on_table:
            self._train_steps = self._groups[0].table.step
            self._steps_on_table = False

    def check_errors(self) -> None:
        """Raises the ``ValueError`` of a batch whose offsets a kernel refused (on a
        GPU step that keeps its counts on the device), waiting for the device (a
        sync). The next call raises it anyway; call this after replaying a CUDA
        graph of the step, where no module code runs (docs/ARCHITECTURE.md, "CUDA
        graphs")."""
        if self._errors is not None:
            self._errors.raise_if_refused(wait_for_device=True)

    def set_train_steps(self, steps: int) -> None:
        """Restores ``train_steps`` (e.g. from a checkpoint)."""
        if int(steps) < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        self._changed()
        self._steps_on_table = False
        self._train_steps = int(steps)

    def next_score(self, table_name: str) -> int:
        """The score the next training batch gives the keys it touches (LRU, LRU_LFU,
        STEP: rows scoring at least this were touched after this call; CUSTOMIZED: the
        score ``set_score`` registered)."""
        group, local = self._location(table_name)
        if group.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
            return int(group.custom_scores[local])
        if group.score_strategy == DynamicEmbScoreStrategy.STEP:
            return self.train_steps + 1
        if group.score_strategy in (DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LRU_LFU):
            return group.table.clock + 1  # LRU_LFU: min_score reads the time part
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
            if group.table.ttl is None:
                continue
            counts = group.storage.expire().tolist()
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

    def prefetch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
        *,
        frequencies: Optional[torch.Tensor] = None,
    ) -> None:
        """Looks up a coming batch now: dedup, hash-table work, rows fetched into the
        device tier (inserting in training). ``forward`` consumes prefetched batches in
        order and must be given the same ``indices``/``offsets``. Results are identical
        to not prefetching (see ``docs/ARCHITECTURE.md`` for the one exception). On a
        GPU step that keeps its counts on the device, bad offsets are raised at the
        next call, as ``forward``'s, and the prefetch changes nothing.

        On CUDA, a prefetch on another stream than the last forward or backward
        first waits for what that stream has enqueued, and the next forward or
        backward on the training stream waits for the prefetch (``StreamOrder``)."""
        self._stream_order.before_use()
        self._raise_refused()
        # a step that keeps its counts on the device checks into a word of its own
        error = (torch.zeros(1, dtype=torch.int64, device=self.device)
                 if self._counted(self.training) else None)
        check = None if error is None else self._check_on_device()
        indices, offsets, _, batch_size = self._validate(indices, offsets, per_sample_weights,
                                                         check, word=error)
        frequencies = self._validate_frequencies(frequencies, indices.numel())
        lookups = self._lookup(indices, offsets, batch_size, self.training, frequencies, error)
        self._prefetched.append(_Prefetched(indices, offsets, self.training, lookups, check))
        self._stream_order.used()

    def flush(self) -> None:
        """Writes every device-tier row back to the host store."""
        for g in self._groups:
            g.storage.flush()

    def reset_cache_states(self) -> None:
        """Flushes, then empties every device cache (the next batches start cold)."""
        for g in self._groups:
            g.storage.reset_cache_states()

    def cache_metrics(self) -> Dict[str, TierMetrics]:
        """Per table: lookups, hits, misses, evictions, host rows read and written, rows
        expired (``ttl``: swept, or found expired by a lookup)."""
        return {name: self._location(name)[0].storage.metrics[self._location(name)[1]]
                for name in self.table_names}

    def print_cache_metrics(self) -> None:
        """Prints ``cache_metrics()`` and each group's memory layout."""
        for g in self._groups:
            print(f"{[self.table_names[t] for t in g.table_indices]}: {g.storage.describe()}")
        for name, metrics in self.cache_metrics().items():
            print(f"  {name}: {metrics}")

    def table_size(self, table_name: str) -> int:
        """Rows stored for one table (with a ``ttl``: alive rows, not those expired and
        waiting for a sweep)."""
        group, local = self._location(table_name)
        if (len(group.table_indices) == 1 and group.table.ttl is None
                and group.storage.external is None):
            return group.table.size()
        return sum(int(rows.keys.numel()) for rows in self.iter_keys_values(table_name))

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
        self._raise_refused()
        training = self.training
        counted = self._counted(training)
        check = self._check_on_device() if counted else None
        indices, offsets, weights, batch_size = self._validate(indices, offsets, per_sample_weights,
                                                               check)
        frequencies = self._validate_frequencies(frequencies, indices.numel())
        self._stream_order.before_use()
        error = self._errors.word if counted else None
        if self._prefetched:
            lookups = self._take_prefetched(indices, offsets)
        else:
            lookups = self._lookup(indices, offsets, batch_size, training, frequencies, error)
        batch = _Batch(offsets, None if weights is None else weights.detach(), batch_size,
                       indices.numel(), lookups, error, check)
        if training and torch.is_grad_enabled() and any(g.training for g in self._groups):
            out = _LookupFunction.apply(self._table_params[0], weights, self, batch)
        else:
            out = self._compute_output(batch)
        self._stream_order.used()
        return out if self.output_dtype == torch.float32 else out.to(self.output_dtype)

    def _raise_refused(self) -> None:
        """Raises the error of a batch an earlier call's kernel refused (bad offsets); a
        refused prefetched batch leaves the queue (it changed nothing)."""
        if self._errors is None:
            return
        try:
            self._errors.raise_if_refused()
        except ValueError:
            self._prefetched = deque(p for p in self._prefetched
                                     if p.check is None or not p.check.refused)
            raise

    def _counted(self, training: bool) -> bool:
        """Whether this call's step keeps every count on the device: a backend that
        can, and a lookup every group can run padded (several groups each take
        their part of the whole batch)."""
        return self._errors is not None and all(g.counts_on_device(training)
                                                for g in self._groups)

    def _check_on_device(self) -> CheckedBatch:
        """A batch to be checked by a kernel into the error word (read at the next
        call). Its step's counters (train steps, clock, Adam's step) advance in
        device memory and a refused batch advances none: nothing to put back. The
        module's train steps follow the first group table's step from here (every
        group's table steps with it)."""
        if not self._steps_on_table:
            for g in self._groups:
                g.table.set_step(self._train_steps)
            self._steps_on_table = True
        return CheckedBatch()

    def _validate(self, indices, offsets, weights, check: Optional[CheckedBatch] = None,
                  word: Optional[torch.Tensor] = None):
        """The batch on the module's device, checked: at once, or with ``check`` by a
        kernel into the error word (``InputErrors``; ``word``: a prefetch's own)."""
        pooling = self.pooling_mode
        check_batch_types(indices, offsets, weights, "" if pooling == DynamicEmbPoolingMode.SUM
                          else f"this module uses {pooling.name}")
        for name, t in (("indices", indices), ("offsets", offsets)):
            _check_has_data(t, name)
        num_bags = offsets.numel() - 1
        if num_bags < 0 or num_bags % self._num_features:
            raise ValueError(
                f"offsets must have num_features * batch_size + 1 entries "
                f"(num_features={self._num_features}), got {offsets.numel()}")
        # The batch moves to the rows' device (a no-op when it is there already).
        offsets = offsets.to(device=self.device, dtype=torch.int64).contiguous()
        n = indices.numel()
        if check is None:
            problem = for_device(self.device).check_offsets(offsets=offsets, num_indices=n)
            if problem:
                raise ValueError(offsets_message(problem, offsets, n))
        if weights is not None:
            if weights.shape != (n,):
                raise ValueError(
                    f"per_sample_weights must have shape ({n},) like indices, got {tuple(weights.shape)}")
            _check_has_data(weights, "per_sample_weights")
            weights = weights.to(device=self.device, dtype=torch.float32).contiguous()
            if self._check_data and not _all_finite(weights):
                raise ValueError("per_sample_weights must be finite, got NaN or inf")
        indices = indices.to(device=self.device, dtype=torch.int64).contiguous()
        if check is not None:  # last: a batch refused at once has changed nothing
            for_device(self.device).check_offsets(
                offsets=offsets, num_indices=n, error=self._errors.word if word is None else word)
            check.offsets, check.num_indices = offsets, n
            self._errors.checked(check, word)
        return indices, offsets, weights, num_bags // self._num_features

    def _take_prefetched(self, indices, offsets) -> List[Lookup]:
        head = self._prefetched[0]
        same = (head.indices is indices and head.offsets is offsets) or (  # no read: no sync
            torch.equal(head.indices, indices) and torch.equal(head.offsets, offsets))
        if head.training != self.training or not same:
            raise ValueError(
                "forward got a batch other than the next prefetched one (or another "
                "train/eval mode); prefetched batches are consumed in order")
        self._prefetched.popleft()
        return [g.refresh(found) for g, found in zip(self._groups, head.lookups)]

    def _validate_frequencies(self, frequencies, n: int) -> Optional[torch.Tensor]:
        # their values (>= 1) are read only where that costs no sync, as the weights'
        return check_frequencies(frequencies, n, self.device, like="indices", int32=True,
                                 check_values=self._check_data)

    def _lookup(self, indices, offsets, batch_size, insert: bool,
                frequencies: Optional[torch.Tensor] = None,
                error: Optional[torch.Tensor] = None) -> List[Lookup]:
        """Every group's lookup, atomically: if one group fails (a full table in ERROR
        mode), the groups before it are rolled back and no table changes. ``error``:
        the batch's check word, for a step counted on the device (each group then
        takes its part of the whole batch)."""
        if insert and error is None:  # STEP scores: the training step this forward is
            self._steps_to_host()  # (a counted step advances it on the device)
            for g in self._groups:
                g.table.set_step(self._train_steps + 1)
        pending = []
        parts = self._split_by_group(indices, offsets, batch_size, padded=error is not None)
        try:
            for group, keys, tids, positions, part in parts:
                freq = frequencies
                if freq is not None and positions is not None:
                    freq = freq[positions]
                pending.append(group.begin_lookup(keys, tids, insert, freq, error, part))
        except BaseException:
            for group, p in reversed(list(zip(self._groups, pending))):
                group.abort_lookup(p)
            if error is None:
                for g in self._groups:
                    g.table.set_step(self._train_steps)
            raise
        if insert:
            if error is None:
                self._train_steps += 1
            self._changed()
        lookups = [g.finish_lookup(p) for g, p in zip(self._groups, pending)]
        for g, (found, (_, _, _, positions, _)) in enumerate(zip(lookups, parts)):
            if positions is not None:  # back to positions in the whole batch
                inverse = torch.full((indices.numel(),), -1, dtype=torch.int64, device=self.device)
                inverse[positions] = found.inverse
                rank = None
                if found.rank is not None:
                    rank = torch.full((indices.numel(),), -1, dtype=torch.int64,
                                      device=self.device)
                    rank[positions] = found.rank
                lookups[g] = found._replace(inverse=inverse, rank=rank)
        return lookups

    def _split_by_group(self, indices, offsets, batch_size, padded: bool = False):
        """(group, keys, local table ids, positions in the batch or None, part or None)
        per group. ``padded``: every group gets the whole batch and its
        ``BatchPart`` (no sizes read on the host)."""
        n = indices.numel()
        if len(self._groups) == 1 and len(self._groups[0].table_indices) == 1:
            return [(self._groups[0], indices, self._zero_tids.take(n), None, None)]
        bounds = offsets[:: max(batch_size, 1)] if batch_size else torch.zeros(
            self._num_features + 1, dtype=torch.int64, device=self.device)
        # each lookup's feature: how many features end at or before it (a search, not
        # a repeat: offsets a kernel has yet to refuse still give features in range).
        # The bounds are made contiguous first: over the strided view, torch 2.13's
        # CPU searchsorted gave wrong features now and then (test_exactness caught it
        # in about one run in four, never with a contiguous copy).
        feature = torch.searchsorted(bounds[1:].contiguous(), torch.arange(n, device=self.device),
                                     right=True).clamp_(max=self._num_features - 1)
        tids = self._feature_local_tid[feature]
        if len(self._groups) == 1:
            return [(self._groups[0], indices, tids, None, None)]
        if padded:
            groups = self._feature_group[feature]
            return [(group, indices, tids, None, BatchPart(groups, g))
                    for g, group in enumerate(self._groups)]
        # Each group's lookups in batch order: a stable sort by group, cut at the
        # groups' sizes (read in one sync for all groups, not one per group).
        sizes = torch.zeros(len(self._groups), dtype=torch.int64, device=self.device).index_add_(
            0, self._feature_group, bounds[1:] - bounds[:-1]).tolist()
        order = torch.sort(self._feature_group[feature], stable=True).indices
        return [(group, indices[positions], tids[positions].contiguous(), positions, None)
                for group, positions in zip(self._groups, torch.split(order, sizes))]

    def _compute_output(self, batch: _Batch) -> torch.Tensor:
        mean = self.pooling_mode == DynamicEmbPoolingMode.MEAN
        # Uninitialized: every feature belongs to one group, whose kernel writes all of
        # its rows (sequence) or columns (pooled, zeros for empty bags).
        if self.pooling_mode == DynamicEmbPoolingMode.NONE:
            shape = (batch.num_indices, self.feature_dims[0])
        else:
            shape = (batch.batch_size, sum(self.feature_dims))
        out = self._outputs.empty(shape, torch.float32, self.device)
        pooled = self.pooling_mode != DynamicEmbPoolingMode.NONE
        for g, (group, found) in enumerate(zip(self._groups, batch.lookups)):
            group.forward(found, batch.offsets if pooled else None, batch.weights,
                          self._feature_col[g], batch.batch_size, mean, out, batch.error)
        return out

    def _apply_gradients(self, batch: _Batch, grad: torch.Tensor,
                         want_weight_grad: bool = False) -> Optional[torch.Tensor]:
        """Backward: gradients of the weights (if wanted, from the rows before the
        update), then the fused optimizer on every group."""
        if batch.check is not None and batch.check.refused:  # raised already: no update
            return None
        self._stream_order.before_use()
        grad = grad.to(torch.float32).contiguous()
        pooled = self.pooling_mode != DynamicEmbPoolingMode.NONE
        mean = self.pooling_mode == DynamicEmbPoolingMode.MEAN
        grads = [group.clip(grad) for group in self._groups]  # gradient clipping
        sums = self._summed_gradients(batch, grads) if self._check_data else None
        grad_weights = None
        if want_weight_grad:
            grad_weights = torch.zeros(batch.weights.numel(), dtype=torch.float32,
                                       device=self.device)
            for g, (group, found) in enumerate(zip(self._groups, batch.lookups)):
                group.weight_grad(found, grads[g], batch.offsets, self._feature_col[g],
                                  batch.batch_size, grad_weights, batch.error)
        self._changed()
        for g, (group, found) in enumerate(zip(self._groups, batch.lookups)):
            lr = self.optimizer.param_groups[g]["lr"]
            group.backward(found, grads[g], lr, batch.offsets if pooled else None,
                           batch.weights, self._feature_col[g], batch.batch_size, mean,
                           batch.error, None if sums is None else sums[g])
        self._stream_order.used()
        return grad_weights

    def _summed_gradients(self, batch: _Batch, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Every group's rows' summed gradients (the first pass of their backward),
        checked before any group updates: a NaN/inf in the gradient (or a weight)
        reaches the sum of each row that reads it, so no pass of its own over the
        gradient is needed. Values the step does not read are not checked.

        Raises:
            ValueError: some row's summed gradient holds NaN or inf; no table changed.
        """
        pooled = self.pooling_mode != DynamicEmbPoolingMode.NONE
        shapes = [(found.starts.numel() - 1 if group.training else 0, group.dim)
                  for group, found in zip(self._groups, batch.lookups)]
        sums = self._grad_sums.views(shapes, self.device)
        non_finite = 0
        for g, (group, found) in enumerate(zip(self._groups, batch.lookups)):
            if group.training:
                non_finite += group.sum_gradients(
                    found, grads[g], batch.offsets if pooled else None, batch.weights,
                    self._feature_col[g], batch.batch_size,
                    self.pooling_mode == DynamicEmbPoolingMode.MEAN, sums[g])
        if non_finite:
            raise ValueError(
                "the gradient of the embedding output holds NaN or inf; this batch's update "
                f"is refused and no table changed (the summed gradients of {non_finite} "
                "rows are not finite: look for the non-finite loss upstream)")
        return sums
