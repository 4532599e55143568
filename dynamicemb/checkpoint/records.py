"""One dynamic table as int64 records, the form ``torch.distributed.checkpoint`` carries.

A record is ``RecordLayout.columns`` int64 words: ``kind``, ``key``, ``score``, then
the payload: a row's bytes as the table stores them (``RowFormat``: the embedding in
the table's dtype, then float32 optimizer state, zero-padded to whole words), a
counter's count (float64 bits), or, for the header (first, one per saving rank),
the clocks. The header's key word holds the saved dim in its low 32 bits and the row
dtype's code (``RowFormat.code``: 0 float32, 1 float16, 2 bfloat16) above them, so
records written before 16-bit rows read as float32; its score word holds the state
columns.
"""

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

import torch

from dynamicemb.embedding import TableClocks
from dynamicemb.ops.interface import RowFormat
from dynamicemb.types import ROW_DTYPE_NAMES, ROW_DTYPES

__all__ = ["HEADER", "ROW", "COUNTER", "MIN_COLUMNS", "VIRTUAL_COLUMNS", "VIRTUAL_ROWS",
           "RecordLayout", "TableLoad", "export_records"]

ROW, COUNTER, HEADER = 0, 1, 2
#: The extent a loading rank declares to DCP, so it takes every saved chunk.
VIRTUAL_ROWS = 1 << 62
VIRTUAL_COLUMNS = 1 << 20
_FIXED = 3  # kind, key, score
_HEADER_WORDS = 4  # optimizer step, score clock, admission clock, train steps
#: Fewest columns of any table's records (the header's).
MIN_COLUMNS = _FIXED + _HEADER_WORDS
_DIM_BITS = 32
_DTYPE_OF_CODE = {RowFormat(dtype, 1, 0).code: dtype for dtype in ROW_DTYPES}


@dataclass(frozen=True)
class RecordLayout:
    """The records of a table of ``dim`` embedding columns in ``dtype`` and
    ``state_dim`` float32 optimizer-state columns."""

    dim: int
    state_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, module, table: str) -> "RecordLayout":
        options = module.table_options[module.table_names.index(table)]
        return cls(options.dim, module.optimizer_state_dim(table), options.row_dtype)

    @property
    def format(self) -> RowFormat:
        return RowFormat(self.dtype, self.dim, self.state_dim)

    @property
    def header_key(self) -> int:
        """The header's key word: the dim, and the dtype's code above it."""
        return self.dim | self.format.code << _DIM_BITS

    @property
    def value_words(self) -> int:
        return -(-self.format.row_bytes // 8)

    @property
    def columns(self) -> int:
        return _FIXED + max(self.value_words, _HEADER_WORDS)

    def describe(self) -> str:
        return (f"dim {self.dim} + {self.state_dim} optimizer-state columns, "
                f"{ROW_DTYPE_NAMES[self.dtype]} embeddings")

    def pack_values(self, embeddings: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """Rows as record words (bit copies of the stored rows).

        Shape:
            embeddings: (n, dim) ``dtype``; states: (n, state_dim) float32; returns
            (n, value_words) int64.
        """
        rows = self.format.pack(embeddings, states if self.state_dim else None)
        if rows.shape[1] % 2:
            rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 1)], 1)
        return rows.view(torch.int64)

    def unpack_values(self, words: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Record words as rows: views of ``embeddings`` (n, dim) ``dtype`` and
        ``states`` (n, state_dim) float32 of ``words`` (n, value_words) int64."""
        rows = words.contiguous().view(torch.float32)[:, :self.format.storage_width]
        return self.format.embeddings(rows), self.format.states(rows)

    def difference(self, header: Sequence[int]) -> str:
        """What differs between this layout and the one a header's ``[key, score]``
        words name ("" if nothing)."""
        code, dim = header[0] >> _DIM_BITS, header[0] & ((1 << _DIM_BITS) - 1)
        if code not in _DTYPE_OF_CODE:
            return f"saved with an unknown row dtype (code {code})"
        saved = RecordLayout(dim, header[1], _DTYPE_OF_CODE[code])
        if saved == self:
            return ""
        return f"saved with {saved.describe()}, this table has {self.describe()}"


def export_records(module, table: str, layout: RecordLayout, spare: int = 0) -> torch.Tensor:
    """This module's records of ``table`` (header, rows, counters) and ``spare`` zero
    records, in one (n, columns) int64 tensor; device caches are flushed first."""
    module.flush()
    counters = module.export_admission_counters(table)
    rows = module.table_size(table)
    m = counters.keys.numel()
    out = torch.zeros(1 + rows + m + spare, layout.columns, dtype=torch.int64)
    clocks = module.table_clocks(table)
    out[0, :_FIXED] = torch.tensor([HEADER, layout.header_key, layout.state_dim])
    out[0, _FIXED:_FIXED + _HEADER_WORDS] = torch.tensor(list(clocks) + [module.train_steps])
    filled = 1
    for chunk in module.iter_keys_values(table):
        n = chunk.keys.numel()
        part = out[filled:filled + n]
        part[:, 1], part[:, 2] = chunk.keys, chunk.scores
        part[:, _FIXED:_FIXED + layout.value_words] = layout.pack_values(
            chunk.embeddings.cpu(), chunk.optimizer_states.cpu())
        filled += n
    if filled != 1 + rows:
        raise RuntimeError(f"table {table!r} changed while it was exported")
    tail = out[filled:filled + m]
    tail[:, 0], tail[:, 1], tail[:, 2] = COUNTER, counters.keys.cpu(), counters.scores.cpu()
    tail[:, _FIXED] = counters.counts.cpu().to(torch.float64).view(torch.int64)
    return out


class TableLoad:
    """Loads one table from records arriving chunk by chunk, in any order. The table is
    emptied (clocks zeroed) when the first chunk with a header has passed its checks, so
    that a refused load leaves the table as it was; chunks before it (a rank's records
    start with a header) are held until then: a header's dtype is what tells float16
    records from bfloat16 ones of the same width. Each ``add_records`` imports what this
    rank ``owns(keys)`` ((n,) bool) and sets the clocks to the largest saved so far."""

    def __init__(self, module, table: str, layout: RecordLayout,
                 owns: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module, self.name, self.layout, self.owns = module, table, layout, owns
        self.clocks: List[int] = [0] * _HEADER_WORDS
        self._emptied = False
        self._held: List[torch.Tensor] = []  # chunks that came before the first header

    def add_records(self, records: torch.Tensor) -> None:
        """Imports one chunk of saved records (r, columns) int64; ``ValueError`` if a
        header names another layout (dim, state columns, dtype: both named) or the
        records have another width."""
        kind = records[:, 0]
        headers = records[kind == HEADER, 1:_FIXED + _HEADER_WORDS].tolist()
        for header in headers:
            difference = self.layout.difference(header[:2])
            if difference:
                raise ValueError(f"dynamic table {self.name!r}: {difference}; load with the "
                                 f"same dim, optimizer and embedding dtype, or use "
                                 f"DynamicEmbLoad (optim=False, convert_dtype=True)")
        if records.shape[1] != self.layout.columns:
            raise ValueError(
                f"dynamic table {self.name!r}: saved records have {records.shape[1]} columns, "
                f"this table's have {self.layout.columns} ({self.layout.describe()}); load "
                f"with the same dim, optimizer and embedding dtype, or use DynamicEmbLoad")
        if not self._emptied:
            if not headers:
                self._held.append(records)
                return
            self._emptied = True
            self.module.reset_cache_states()
            self.module.clear_table(self.name)
            self.module.set_table_clocks(self.name, TableClocks(0, 0, 0))
            self.module.set_train_steps(0)
            held, self._held = self._held, []
            for chunk in held:
                self._import(chunk)
        for header in headers:
            self.clocks = [max(a, b) for a, b in zip(self.clocks, header[2:])]
        self._import(records)

    def _import(self, records: torch.Tensor) -> None:
        kind = records[:, 0]
        rows = records[(kind == ROW) & self.owns(records[:, 1])]
        if rows.shape[0]:
            embeddings, states = self.layout.unpack_values(
                rows[:, _FIXED:_FIXED + self.layout.value_words])
            self.module.import_keys_values(self.name, rows[:, 1], embeddings, states,
                                           scores=rows[:, 2])
        counters = records[(kind == COUNTER) & self.owns(records[:, 1])]
        if counters.shape[0]:
            self.module.import_admission_counters(
                self.name, counters[:, 1], counters[:, _FIXED].contiguous().view(torch.float64),
                counters[:, 2])
        self.module.set_table_clocks(self.name, TableClocks(*self.clocks[:3]))
        self.module.set_train_steps(max(self.module.train_steps, self.clocks[3]))
