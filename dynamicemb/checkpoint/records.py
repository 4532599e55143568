"""One dynamic table as int64 records, the form ``torch.distributed.checkpoint`` carries.

A record is ``RecordLayout.columns`` int64 words: ``kind``, ``key``, ``score``, then
the payload: a row's embedding and optimizer state (float32, two per word), a
counter's count (float64 bits), or, for the header (first, one per saving rank),
the clocks; the header's key and score words hold the saved dim and state columns.
"""

from dataclasses import dataclass
from typing import Callable, List

import torch

from dynamicemb.embedding import TableClocks

__all__ = ["HEADER", "ROW", "COUNTER", "VIRTUAL_COLUMNS", "VIRTUAL_ROWS", "RecordLayout",
           "TableLoad", "export_records"]

ROW, COUNTER, HEADER = 0, 1, 2
#: The extent a loading rank declares to DCP, so it takes every saved chunk.
VIRTUAL_ROWS = 1 << 62
VIRTUAL_COLUMNS = 1 << 20
_FIXED = 3  # kind, key, score
_HEADER_WORDS = 4  # optimizer step, score clock, admission clock, train steps


@dataclass(frozen=True)
class RecordLayout:
    """The record width of a table of ``dim`` + ``state_dim`` columns."""

    dim: int
    state_dim: int

    @classmethod
    def of(cls, module, table: str) -> "RecordLayout":
        return cls(module.dims[module.table_names.index(table)], module.optimizer_state_dim(table))

    @property
    def value_words(self) -> int:
        return (self.dim + self.state_dim + 1) // 2

    @property
    def columns(self) -> int:
        return _FIXED + max(self.value_words, _HEADER_WORDS)

    def describe(self) -> str:
        return f"dim {self.dim} + {self.state_dim} optimizer-state columns"

    def pack_values(self, values: torch.Tensor) -> torch.Tensor:
        """(n, dim + state_dim) float32 -> (n, value_words) int64 (bit copies)."""
        if values.shape[1] % 2:
            values = torch.cat([values, values.new_zeros(values.shape[0], 1)], 1)
        return values.contiguous().view(torch.int64)

    def unpack_values(self, words: torch.Tensor) -> torch.Tensor:
        """(n, value_words) int64 -> (n, dim + state_dim) float32."""
        return words.contiguous().view(torch.float32)[:, :self.dim + self.state_dim]


def export_records(module, table: str, layout: RecordLayout, spare: int = 0) -> torch.Tensor:
    """This module's records of ``table`` (header, rows, counters) and ``spare`` zero
    records, in one (n, columns) int64 tensor; device caches are flushed first."""
    module.flush()
    counters = module.export_admission_counters(table)
    rows = module.table_size(table)
    m = counters.keys.numel()
    out = torch.zeros(1 + rows + m + spare, layout.columns, dtype=torch.int64)
    clocks = module.table_clocks(table)
    out[0, :_FIXED] = torch.tensor([HEADER, layout.dim, layout.state_dim])
    out[0, _FIXED:_FIXED + _HEADER_WORDS] = torch.tensor(list(clocks) + [module.train_steps])
    filled = 1
    for chunk in module.iter_keys_values(table):
        n = chunk.keys.numel()
        part = out[filled:filled + n]
        part[:, 1], part[:, 2] = chunk.keys, chunk.scores
        values = torch.cat([chunk.embeddings, chunk.optimizer_states], 1).cpu()
        part[:, _FIXED:_FIXED + layout.value_words] = layout.pack_values(values)
        filled += n
    if filled != 1 + rows:
        raise RuntimeError(f"table {table!r} changed while it was exported")
    tail = out[filled:filled + m]
    tail[:, 0], tail[:, 1], tail[:, 2] = COUNTER, counters.keys.cpu(), counters.scores.cpu()
    tail[:, _FIXED] = counters.counts.cpu().to(torch.float64).view(torch.int64)
    return out


class TableLoad:
    """Loads one table from records arriving chunk by chunk, in any order: ``begin``
    empties it and zeroes its clocks; each ``add_records`` imports what this rank
    ``owns(keys)`` ((n,) bool) and sets the clocks to the largest saved so far."""

    def __init__(self, module, table: str, layout: RecordLayout,
                 owns: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module, self.name, self.layout, self.owns = module, table, layout, owns
        self.clocks: List[int] = [0] * _HEADER_WORDS

    def begin(self) -> None:
        self.module.reset_cache_states()
        self.module.clear_table(self.name)
        self.module.set_table_clocks(self.name, TableClocks(0, 0, 0))
        self.module.set_train_steps(0)

    def add_records(self, records: torch.Tensor) -> None:
        """Imports one chunk of saved records (r, columns) int64."""
        kind = records[:, 0]
        for header in records[kind == HEADER, 1:_FIXED + _HEADER_WORDS].tolist():
            if header[:2] != [self.layout.dim, self.layout.state_dim]:
                raise ValueError(
                    f"dynamic table {self.name!r}: saved with dim {header[0]} + {header[1]} "
                    f"optimizer-state columns, this table has {self.layout.describe()}")
            self.clocks = [max(a, b) for a, b in zip(self.clocks, header[2:])]
        rows = records[(kind == ROW) & self.owns(records[:, 1])]
        if rows.shape[0]:
            values = self.layout.unpack_values(rows[:, _FIXED:_FIXED + self.layout.value_words])
            self.module.import_keys_values(self.name, rows[:, 1], values[:, :self.layout.dim],
                                           values[:, self.layout.dim:], scores=rows[:, 2])
        counters = records[(kind == COUNTER) & self.owns(records[:, 1])]
        if counters.shape[0]:
            self.module.import_admission_counters(
                self.name, counters[:, 1], counters[:, _FIXED].contiguous().view(torch.float64),
                counters[:, 2])
        self.module.set_table_clocks(self.name, TableClocks(*self.clocks[:3]))
        self.module.set_train_steps(max(self.module.train_steps, self.clocks[3]))
