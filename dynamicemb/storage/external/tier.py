"""The third tier: an external store below a group's host store (docs/ARCHITECTURE.md,
"The external tier"). Each key lives in one tier, so training is bit-identical to a
host store holding every row. A store failure in a step's first phase aborts the step;
a failed deletion after the commit is masked by the host store and retried."""

import logging
from typing import Iterator, NamedTuple, Optional

import torch

from dynamicemb.ops.interface import Entries, RowFormat
from dynamicemb.kvstore.store import ExternalStorageError, KVStore
from dynamicemb.kvstore.store import brief_error as _brief
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["ExternalTier", "Staged"]

logger = logging.getLogger(__name__)


class Staged(NamedTuple):
    """What a step's first phase fetched from below, for ``restore``.

    Shape:
        at: (r,) positions among the prepared keys of keys found below; scores: (r,)
        their stored scores; rows: (r, width).
    """

    at: torch.Tensor
    scores: torch.Tensor
    rows: torch.Tensor
    written: torch.Tensor  # (v,) the table ids of the victims written below


class ExternalTier:
    """A ``KVStore`` under a host store of rows of ``row_format``; ``label`` names its
    tables in messages.

    Raises:
        ValueError: the store holds rows of another width or format.
    """

    #: rows live below: reads and writes go to the store
    holds_rows = True

    def __init__(self, store: KVStore, host: ScoredHashTable, label: str,
                 row_format: RowFormat) -> None:
        if store.row_width != host.value_dim or store.row_format != row_format.tag:
            raise ValueError(f"external store {store.name} holds rows of format "
                             f"{store.row_format} ({store.row_width} words), tables {label} "
                             f"need {row_format.tag} ({host.value_dim} words)")
        self.store = store
        self.host = host
        self.label = label
        self._stale: Optional[tuple] = None  # (keys, tids) to delete below, retried

    def _call(self, what: str, verb, *args):
        """``verb(*args)``; a failure re-raised as ``ExternalStorageError`` naming the tables."""
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
        """Phase one, before the host store commits its insert of ``keys`` (n,), on its device:
        writes ``victims`` (current rows) below and reads the rows of the keys ``new`` ((n,)
        bool, or None) to the host store.

        Raises:
            ExternalStorageError: the store failed, or ``failed`` keys found no host slot;
                the caller aborts the insert.
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
        """Phase two, after the commit initialized the new rows: the rows ``stage`` found take
        their host ``slots`` (n,) and scores (LFU adds the stored count), and are deleted
        below. Returns their (r,) positions among ``keys`` (not new after all)."""
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
        """The rows below scoring at least ``min_score``, at most ``chunk`` per item, on the
        host store's device, skipping keys the host store holds; ``slots`` are -1."""
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
