"""Per-table administration of ``BatchedDynamicEmbeddingTables``: export and
import of rows and admission counters, clearing a table, its clocks, scores,
optimizer settings and size.

``TableAdmin`` holds these methods; ``BatchedDynamicEmbeddingTables`` inherits it.
They find a table's group with the module's ``_location`` and mark changes with
its ``_changed``.
"""

from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch

from dynamicemb.embedding.group import TableGroup
from dynamicemb.embedding.records import ExportedCounters, ExportedRows, TableClocks
from dynamicemb.options import DynamicEmbOptimizerArgs, DynamicEmbOptimType
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["TableAdmin"]


class TableAdmin:
    """The per-table methods of ``BatchedDynamicEmbeddingTables`` (a mixin: they use
    the module's attributes, set in its ``__init__``)."""

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
            if group.storage.external.holds_rows:  # every tier's rows
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

    def read_rows(self, table_name: str, keys: torch.Tensor, train: bool = True) -> torch.Tensor:
        """The current embeddings of ``keys`` in one table, read without changing
        anything (no insert, score, clock or promotion): a stored row from the tier
        holding it (the external tier's too), else the row a training insert would
        store (the table's initializer), or with ``train=False`` what an eval lookup
        reads (the eval initializer's row).

        Args:
            keys (Tensor): (n,) int64.
            train: an absent key's row is the training initializer's (else the eval's).

        Returns:
            (n, dim) float32 on the module's device.
        """
        group, local = self._location(table_name)
        keys = keys.to(self.device, torch.int64).contiguous()
        tids = torch.full((keys.numel(),), local, dtype=torch.int16, device=self.device)
        return group.read_rows(keys, tids, train)

    def _resolve(self, table_name: str, keys: torch.Tensor):
        """(group, keys, table ids, read-only references) of keys of one table."""
        group, local = self._location(table_name)
        keys = keys.to(self.device, torch.int64).contiguous()
        tids = torch.full((keys.numel(),), local, dtype=torch.int16, device=self.device)
        return group, keys, tids, group.storage.resolve(keys, tids)

    def holds(self, table_name: str, keys: torch.Tensor) -> torch.Tensor:
        """(n,) bool on the module's device: whether a tier stores each of ``keys`` in
        one table (the external tier asked from the host), read without changing
        anything."""
        group, keys, tids, refs = self._resolve(table_name, keys)
        return group.storage.or_below(keys, tids, refs >= 0)

    def read_optimizer_states(self, table_name: str, keys: torch.Tensor) -> torch.Tensor:
        """The optimizer states of ``keys`` in one table, read without changing
        anything (as ``read_rows``): a stored row's from the tier holding it, else
        the optimizer's initial state (what an insert stores; also for a row only
        the external tier holds).

        Args and device: as ``read_rows``'s; returns (n, state_dim) float32.
        """
        group, _, _, refs = self._resolve(table_name, keys)
        return group.storage.columns_of(refs, group.dim, float(group.init.initial_state))

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

    def step_rows(self, table_name: str, values: torch.Tensor, grads: torch.Tensor) -> None:
        """One step of a table's optimizer (its kernel, at the current learning rate),
        in place, on rows a caller holds: what a backward does to a stored row
        (stale replicas' write-back copies). Not for ADAM (its step counts calls).

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

    def table_size(self, table_name: str) -> int:
        """Rows stored for one table (with a ``ttl``: alive rows, not those expired and
        waiting for a sweep)."""
        group, local = self._location(table_name)
        if (len(group.table_indices) == 1 and group.table.ttl is None
                and not group.storage.external.holds_rows):
            return group.table.size()
        return sum(int(rows.keys.numel()) for rows in self.iter_keys_values(table_name))
