"""The third tier: an external store below a group's host store.

With an external tier the host store holds at most its budget of rows. What it
evicts goes down (``stage`` writes the victims before the host commits), and a key
the host store inserts is first looked up below: a row found there comes back with
its score instead of being initialized (``restore``). Each key lives in one tier:
a row that comes back is deleted below. Training is therefore bit-identical to a
host store holding every row, whatever the split.

All store traffic of a step happens in its first phase: a failing store aborts the
host store's prepared insert, so the step is undone and raises
``ExternalStorageError`` naming the store and the table. Only the deletion of rows
that came back follows the commit; if it fails, the stale copies are masked by the
host store (which every lookup asks first), retried with the next step, and never
exported.
"""

import logging
from typing import Iterator, NamedTuple, Optional

import torch

from dynamicemb.ops.interface import Entries
from dynamicemb.kvstore.store import ExternalStorageError, KVStore
from dynamicemb.kvstore.store import brief_error as _brief
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["ExternalTier", "Staged"]

logger = logging.getLogger(__name__)


class Staged(NamedTuple):
    """What a step's first phase fetched from below, for ``restore``.

    Shape:
        at: (r,) positions, among the prepared keys, of keys found below;
        scores: (r,) their stored scores; rows: (r, width) their rows.
    """

    at: torch.Tensor
    scores: torch.Tensor
    rows: torch.Tensor
    written: torch.Tensor  # (v,) the table ids of the victims written below


class ExternalTier:
    """A ``KVStore`` under a host store (``NothingBelow`` is the storage's tier below
    when there is none).

    Args:
        store: the open store.
        host: the host store it backs.
        label: the tables it holds, for messages.
    """

    #: rows live below: reads and writes go to the store
    holds_rows = True

    def __init__(self, store: KVStore, host: ScoredHashTable, label: str) -> None:
        if store.row_width != host.value_dim:
            raise ValueError(f"external store {store.name} holds rows of {store.row_width} "
                             f"floats, tables {label} need {host.value_dim}")
        self.store = store
        self.host = host
        self.label = label
        self._stale: Optional[tuple] = None  # (keys, tids) to delete below, retried

    def _call(self, what: str, verb, *args):
        """``verb(*args)``, with a store's failure re-raised naming the store and tables."""
        try:
            return verb(*args)
        except ExternalStorageError as e:
            raise ExternalStorageError(f"{e} (tables {self.label})") from e
        except Exception as e:
            raise ExternalStorageError(
                f"external store {self.store.name} of tables {self.label} failed to {what}: "
                f"{type(e).__name__}: {_brief(e)}") from e

    # ------------------------------------------------------------- a step
    def stage(self, keys: torch.Tensor, tids: torch.Tensor, new: Optional[torch.Tensor],
              failed: int, victims: Entries) -> Staged:
        """Phase one, before the host store commits its prepared insert of ``keys``:
        writes ``victims`` (the rows the insert evicts, current values) below and
        reads the rows of the keys new to the host store. Raises
        ``ExternalStorageError``; the caller aborts the insert.

        Args:
            keys, tids: (n,) the prepared keys, on the host store's device.
            new: (n,) bool, the keys new to the host store (None: none is).
            failed: how many of them found no slot (a batch must fit: refused).
            victims: entries the insert evicts from the host store.
        """
        if failed:
            raise ExternalStorageError(
                f"tables {self.label}: {failed} of {keys.numel()} keys found no "
                f"slot in the host store of {self.host.max_capacity()} rows in front of "
                f"{self.store.name}: a batch must fit in the host budget (raise "
                f"local_host_for_values or bucket_capacity)")
        self._retry_stale()
        if victims.keys.numel():
            self._call("write evicted rows", self.store.put, victims.keys.cpu(),
                       victims.table_ids.cpu(), victims.values.cpu(), victims.scores.cpu())
        empty = torch.empty(0, dtype=torch.int64)
        new_at = empty if new is None else new.nonzero().squeeze(1)
        if new_at.numel() == 0:
            return Staged(empty, empty, torch.empty(0, self.store.row_width), victims.table_ids)
        found, rows = self._call("read rows", self.store.get, keys[new_at].cpu(),
                                 tids[new_at].cpu())
        return Staged(new_at[found.to(new_at.device)], rows.scores, rows.rows,
                      victims.table_ids)

    def restore(self, slots: torch.Tensor, staged: Staged, keys: torch.Tensor,
                tids: torch.Tensor) -> torch.Tensor:
        """Phase two, after the host store committed and initialized its new rows: the
        rows found below take their host slots with their scores (LFU adds the stored
        count to this batch's) and are deleted below.

        Args:
            slots: (n,) the committed insert's host slots of ``keys``.
            staged: what ``stage`` fetched for that insert.
            keys, tids: (n,) the prepared keys.

        Returns:
            (r,) positions among ``keys`` of those rows, which are not new to the
            table after all.
        """
        device = self.host.device
        at = staged.at.to(device)
        if at.numel() == 0:
            return at
        slots = slots[at]
        self.host.values[slots] = staged.rows.to(device)
        if self.host.score_strategy == DynamicEmbScoreStrategy.LFU:  # counts add up
            self.host.set_scores_at(slots, staged.scores.to(device) + self.host.scores_at(slots))
        # the other strategies give a key the same score whether it was found or new
        self._delete_below(keys[at].cpu(), tids[at].cpu())
        return at

    def _delete_below(self, keys: torch.Tensor, tids: torch.Tensor) -> None:
        try:
            self.store.delete(keys, tids)
        except Exception as e:  # masked by the host store; retried with the next step
            logger.warning("external store %s of tables %s: deleting %d rows that came back "
                           "failed (%s); retried with the next step", self.store.name,
                           self.label, keys.numel(), e)
            if self._stale is not None:
                keys, tids = torch.cat([self._stale[0], keys]), torch.cat([self._stale[1], tids])
            self._stale = (keys, tids)

    def _retry_stale(self) -> None:
        if self._stale is None:
            return
        keys, tids = self._stale
        live = self.host.find(keys.to(self.host.device), tids.to(self.host.device)) >= 0
        at = live.cpu().nonzero().squeeze(1)  # stale only while the host holds the key
        self._call("delete rows that came back", self.store.delete, keys[at], tids[at])
        self._stale = None

    # ------------------------------------------------------ other verbs
    def get(self, keys: torch.Tensor, tids: torch.Tensor):
        """(found (n,) bool, ``StoredRows`` of the found keys) on the CPU."""
        return self._call("read rows", self.store.get, keys.cpu(), tids.cpu())

    def put(self, entries: Entries) -> None:
        """Writes entries (the host store's victims outside a step)."""
        if entries.keys.numel():
            self._call("write evicted rows", self.store.put, entries.keys.cpu(),
                       entries.table_ids.cpu(), entries.values.cpu(), entries.scores.cpu())

    def delete(self, keys: torch.Tensor, tids: torch.Tensor) -> None:
        if keys.numel():
            self._call("delete rows", self.store.delete, keys.cpu(), tids.cpu())

    def export_chunks(self, chunk: int, min_score: Optional[int] = None) -> Iterator[Entries]:
        """The rows below, at most ``chunk`` per item, scoring at least ``min_score``,
        on the host store's device; keys the host store holds are skipped (its row is
        the current one). ``slots`` are -1."""
        device = self.host.device
        scan = self._call("scan", self.store.scan, chunk)
        while True:
            part = self._call("scan", next, scan, None)
            if part is None:
                return
            keep = self.host.find(part.keys.to(device), part.table_ids.to(device)) < 0
            if min_score is not None:
                keep &= part.scores.to(device) >= int(min_score)
            keep = keep.cpu()
            if bool(keep.any()):
                yield Entries(keys=part.keys[keep].to(device),
                              table_ids=part.table_ids[keep].to(device),
                              scores=part.scores[keep].to(device),
                              slots=torch.full((int(keep.sum()),), -1, dtype=torch.int64,
                                               device=device),
                              values=part.rows[keep].to(device))

    def clear_table(self, tid: int, only_table: bool) -> None:
        """Removes the rows of local table ``tid`` below (every row when ``only_table``)."""
        if only_table:
            self._call("clear", self.store.clear)
            return
        doomed = [(c.keys[c.table_ids == tid], c.table_ids[c.table_ids == tid])
                  for c in self._call("scan", lambda: list(self.store.scan()))]
        for keys, tids in doomed:
            self.delete(keys, tids)

    def flush(self) -> None:
        self._call("flush", self.store.flush)

    def describe(self) -> str:
        return f"external store {self.store.name}"

    def over(self) -> str:
        """What a storage's description adds for this tier below it."""
        return f", over {self.describe()}"
