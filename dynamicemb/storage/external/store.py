"""The external store's interface: batched verbs over whole tensors.

A store holds rows of one physical group below its host store. A stored entry is
``(table id, key) -> (score, row)``: the row is what the host store keeps for the
key (embedding and optimizer state, float32) and the score its eviction score, so
nothing is lost when a row goes down a tier and comes back.

Stores speak bytes: ``KVStore`` packs a batch's keys and rows into fixed-size byte
strings with tensor views (no Python arithmetic per key) and leaves four raw verbs
to a backend (``_get``, ``_put``, ``_delete``, ``_scan``):

- key: 8 bytes of the int64 key, then 2 bytes of the int16 table id (little endian),
  after the store's namespace prefix where the backend needs one;
- value: 8 bytes of the int64 score, then the row's ``row_width`` float32s.
"""

import abc
from itertools import compress
from typing import Iterator, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

__all__ = ["ExternalStorageError", "KVStore", "StoredRows", "KEY_BYTES", "SCORE_BYTES"]

KEY_BYTES = 10  # int64 key + int16 table id
SCORE_BYTES = 8


class ExternalStorageError(RuntimeError):
    """An external store failed (unreachable, full, too slow, or returned a row of the
    wrong size). The message names the store and the table."""


class StoredRows(NamedTuple):
    """Entries of an external store.

    Shape:
        keys, table_ids, scores: (n,) int64; rows: (n, row_width) float32.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    scores: torch.Tensor
    rows: torch.Tensor


class KVStore(abc.ABC):
    """A key-value store for rows of ``row_width`` float32s, by (table id, key).

    Args:
        name: how messages name the store (e.g. ``rocksdb:/data/emb``).
        row_width: floats per row.

    Every verb takes a whole batch; tensors are on the CPU (the tier moves them).
    """

    def __init__(self, name: str, row_width: int) -> None:
        if row_width <= 0:
            raise ValueError(f"row_width must be positive, got {row_width}")
        self.name = name
        self.row_width = row_width
        self.value_bytes = SCORE_BYTES + 4 * row_width

    # -------------------------------------------------------------- verbs
    def get(self, keys: torch.Tensor, table_ids: torch.Tensor) -> StoredRows:
        """The stored entries of ``keys`` that the store holds.

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor): (n,) integer local table ids.

        Returns:
            (found, ``StoredRows`` of the found keys in input order): found is (n,) bool.

        Raises:
            ExternalStorageError: a stored value is not ``value_bytes`` long.
        """
        values = self._get(self._pack_keys(keys, table_ids)) if keys.numel() else []
        found = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        hits = list(compress(values, found))
        if hits and set(map(len, hits)) != {self.value_bytes}:
            sizes = sorted(set(map(len, hits)))
            raise ExternalStorageError(
                f"external store {self.name} returned rows of {sizes} bytes, expected "
                f"{self.value_bytes} (a score and {self.row_width} floats): written by a table "
                f"of another width, or corrupted")
        at = torch.from_numpy(np.flatnonzero(found))  # index_select: faster than a mask
        packed = np.frombuffer(b"".join(hits), dtype=np.uint8).reshape(len(hits), self.value_bytes)
        scores, rows = self._unpack_values(packed)
        return torch.from_numpy(found), StoredRows(keys.index_select(0, at),
                                                   table_ids.index_select(0, at).long(),
                                                   scores, rows)

    def put(self, keys: torch.Tensor, table_ids: torch.Tensor, rows: torch.Tensor,
            scores: torch.Tensor) -> None:
        """Writes entries (inserting or overwriting).

        Args:
            keys (Tensor): (n,) int64, unique.
            table_ids (Tensor): (n,) integer local table ids.
            rows (Tensor): (n, row_width) float32.
            scores (Tensor): (n,) int64.
        """
        n = keys.numel()
        if rows.shape != (n, self.row_width):
            raise ValueError(f"rows must have shape ({n}, {self.row_width}), got {tuple(rows.shape)}")
        if n:
            self._put(self._pack_keys(keys, table_ids), self._pack_values(rows, scores))

    def delete(self, keys: torch.Tensor, table_ids: torch.Tensor) -> None:
        """Removes entries (absent keys are ignored)."""
        if keys.numel():
            self._delete(self._pack_keys(keys, table_ids))

    def scan(self, chunk: int = 1 << 16) -> Iterator[StoredRows]:
        """Every entry, at most ``chunk`` per item (in no particular order). The store
        must not change while the iterator is used."""
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        for keys, values in self._scan(chunk):
            if not keys:
                continue
            key, tid = unpack_keys(keys)
            if set(map(len, values)) != {self.value_bytes}:
                raise ExternalStorageError(
                    f"external store {self.name} holds rows of another size than "
                    f"{self.value_bytes} bytes")
            scores, rows = self._unpack_values(
                np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), -1))
            yield StoredRows(key, tid, scores, rows)

    def clear(self) -> None:
        """Removes every entry of this store (its namespace only)."""
        for chunk in self.scan():
            self.delete(chunk.keys, chunk.table_ids)

    def flush(self) -> None:
        """Makes written entries durable where the backend can (default: nothing)."""

    def close(self) -> None:
        """Releases the store's resources (default: nothing)."""

    # ------------------------------------------------------ backend verbs
    @abc.abstractmethod
    def _get(self, keys: List[bytes]) -> Sequence[Optional[bytes]]:
        """The value of each key, None where absent."""

    @abc.abstractmethod
    def _put(self, keys: List[bytes], values: List[bytes]) -> None:
        """Writes the pairs."""

    @abc.abstractmethod
    def _delete(self, keys: List[bytes]) -> None:
        """Removes the keys."""

    @abc.abstractmethod
    def _scan(self, chunk: int) -> Iterator[tuple]:
        """(keys, values) lists of at most ``chunk`` entries of this store's namespace;
        keys as ``_pack_keys`` made them."""

    # ------------------------------------------------------------ packing
    def _key_prefix(self) -> bytes:
        """Bytes put before every packed key (a backend's namespace)."""
        return b""

    def _pack_keys(self, keys: torch.Tensor, table_ids: torch.Tensor) -> List[bytes]:
        n = keys.numel()
        if table_ids.shape != (n,):
            raise ValueError(f"table_ids must have shape ({n},), got {tuple(table_ids.shape)}")
        prefix = self._key_prefix()
        packed = np.empty((n, len(prefix) + KEY_BYTES), dtype=np.uint8)
        packed[:, :len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        packed[:, len(prefix):len(prefix) + 8] = (
            keys.detach().cpu().to(torch.int64).contiguous().view(torch.uint8).reshape(n, 8).numpy())
        packed[:, -2:] = (table_ids.detach().cpu().to(torch.int16).contiguous()
                          .view(torch.uint8).reshape(n, 2).numpy())
        return packed.view(f"V{packed.shape[1]}").reshape(n).tolist() if n else []

    def _pack_values(self, rows: torch.Tensor, scores: torch.Tensor) -> List[bytes]:
        n = rows.shape[0]
        packed = np.empty((n, self.value_bytes), dtype=np.uint8)
        packed[:, :SCORE_BYTES] = (scores.detach().cpu().to(torch.int64).contiguous()
                                   .numpy().view(np.uint8).reshape(n, SCORE_BYTES))
        packed[:, SCORE_BYTES:] = (rows.detach().cpu().to(torch.float32).contiguous()
                                   .numpy().view(np.uint8).reshape(n, -1))
        return packed.view(f"V{self.value_bytes}").reshape(n).tolist()

    def _unpack_values(self, packed: np.ndarray):
        packed = packed.reshape(-1, self.value_bytes)
        scores = _columns(packed, 0, SCORE_BYTES, "<i8").reshape(-1)
        rows = _columns(packed, SCORE_BYTES, self.value_bytes, "<f4").reshape(-1, self.row_width)
        return scores, rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, row_width={self.row_width})"


def _columns(packed: np.ndarray, start: int, end: int, dtype: str) -> torch.Tensor:
    """Bytes ``[start, end)`` of each row of ``packed`` (n, b) uint8, as ``dtype``
    (a copy, as a tensor)."""
    return torch.from_numpy(packed[:, start:end].copy().view(dtype))


def unpack_keys(keys: Sequence[bytes]):
    """(keys int64, table ids int64) of packed keys (their last ``KEY_BYTES``)."""
    packed = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)[:, -KEY_BYTES:]
    return (_columns(packed, 0, 8, "<i8").reshape(-1),
            _columns(packed, 8, KEY_BYTES, "<i2").reshape(-1).long())
