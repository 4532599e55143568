"""``BatchedDynamicEmbeddingTables``: many dynamic tables behind one TBE-style module.

The calling convention is FBGEMM's table-batched embedding: ``indices`` (all
lookups, feature-major) and ``offsets`` (``num_features * batch + 1`` bag
boundaries, bag ``f * batch + b``). The optimizer is fused into backward: there
is no separate ``step()``.
"""

import logging
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence

import torch
from torch import nn

from dynamicemb.embedding.buffers import OutputBuffers, Scratch
from dynamicemb.embedding.fused_params import check_tbe_keywords, output_dtype_of
from dynamicemb.embedding.group import TableGroup, group_key
from dynamicemb.embedding.input_errors import InputErrors
from dynamicemb.embedding.records import ExportedCounters, ExportedRows, TableClocks
from dynamicemb.embedding.state import load_tables_state, tables_state
from dynamicemb.embedding.step import StepPipeline, _Batch, _LookupFunction, _Prefetched
from dynamicemb.embedding.streams import StreamOrder
from dynamicemb.embedding.table_admin import TableAdmin
from dynamicemb.embedding.upstream_members import UpstreamMembers
from dynamicemb.ops import for_device, resolve_device
from dynamicemb.optimizer import DynamicEmbFusedOptimizer
from dynamicemb.storage import TierMetrics
from dynamicemb.table.shared_zeros import SharedZeros
from dynamicemb.options import (
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from dynamicemb.types import DynamicEmbGradientCheck

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedCounters", "ExportedRows", "TableClocks"]

logger = logging.getLogger(__name__)


class BatchedDynamicEmbeddingTables(UpstreamMembers, TableAdmin, StepPipeline, nn.Module):
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
            ``stochastic_rounding``, ``max_norm``, ...): each is accepted where dynamic
            tables do what it asks and refused otherwise (``fused_params.py``).

    Every argument after ``feature_table_map`` is keyword-only (upstream's positional
    order differs).

    The per-table calls (export, import, clocks, admission counters, size) are
    ``TableAdmin``'s (``table_admin.py``); the step behind ``forward`` and
    ``prefetch`` is ``StepPipeline``'s (``step.py``).

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
            self.gradient_check = DynamicEmbGradientCheck(gradient_check)
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
        self._version = 0  # see content_version
        self._prefetched: Deque[_Prefetched] = deque()
        self._outputs = OutputBuffers()
        self._grad_sums = Scratch()  # the backward's per-row gradient sums (CPU)
        self._stream_order = StreamOrder(self.device)
        self._zero_tids = SharedZeros(torch.int16, self.device)  # a one-table module's
        # Checks of a batch's values (finite weights and gradients) where they cost no
        # host sync: on the CPU; on a GPU a step does not wait for them.
        self._check_data = for_device(self.device).free_host_reads
        # The step checks its offsets into this word, read by the host at the next
        # call; where reading it costs nothing (the CPU), in the call itself.
        self._errors = InputErrors(self.device,
                                   at_once=sync_checks or for_device(self.device).free_host_reads)

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


    @property
    def train_steps(self) -> int:
        """Training forwards so far: the STEP strategy scores a batch's keys with
        ``train_steps + 1``."""
        return self._groups[0].train_steps

    def check_errors(self) -> None:
        """Raises the ``ValueError`` of a batch whose offsets a kernel refused (on a
        GPU step that keeps its counts on the device), waiting for the device (a
        sync). The next call raises it anyway; call this after replaying a CUDA
        graph of the step, where no module code runs (docs/ARCHITECTURE.md, "CUDA
        graphs")."""
        self._errors.raise_if_refused(wait_for_device=True)

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
        # a prefetched batch checks into a word of its own
        error = torch.zeros(1, dtype=torch.int64, device=self.device)
        check = self._check_on_device()
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

    def release_graphs(self) -> None:
        """Declares that no CUDA graph captured over this module replays any more: its
        tables may grow again (a table a graph captured refuses to grow, since growth
        replaces the arrays the replays use). Capture again after the growth."""
        for g in self._groups:
            g.storage.release_graphs()

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
        check = self._check_on_device()
        indices, offsets, weights, batch_size = self._validate(indices, offsets, per_sample_weights,
                                                               check)
        frequencies = self._validate_frequencies(frequencies, indices.numel())
        self._stream_order.before_use()
        error = self._errors.word
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
