"""Records the module's per-table calls return, apart from the module so that their readers
(``state.py``, checkpoints) import no module code."""

from typing import NamedTuple

import torch

__all__ = ["ExportedCounters", "ExportedRows", "TableClocks"]


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
    sharing a group share them).

    Attributes:
        optimizer_step: backward passes the group's optimizer applied, counted with
            Adam (its bias correction) and with 16-bit rows (their rounding step); 0
            otherwise.
        score_clock: the host store's clock (the LRU score of the latest inserting call).
        admission_clock: the admission counters' clock (0 without admission).
    """

    optimizer_step: int
    score_clock: int
    admission_clock: int
