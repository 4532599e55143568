"""The external store's interface: batched verbs over whole tensors.

A store holds one physical group's ``(table id, key) -> (score, row)`` below its host
store. Packed key: namespace prefix, int64 key, int16 table id; value: int64 score,
``row_width`` float32 words (little endian; a 16-bit row's words hold its 16-bit
embedding and float32 state, ``RowFormat``). Each server of a namespace also holds a
**mark** (``MARK`` after the prefix) naming the owning store object and the format of
its rows (``claim``); every call checks it, so a server that lost its data or a
namespace taken over fails it, and a module of another row format cannot take it over.
"""

import abc
import logging
import os
import re
import socket
import time
import uuid
from itertools import compress
from typing import Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["ExternalStorageError", "KVStore", "StoredRows", "KEY_BYTES", "MARK", "SCORE_BYTES",
           "UNRECORDED_FORMAT", "brief_error", "marked_format"]

logger = logging.getLogger(__name__)

KEY_BYTES = 10  # int64 key + int16 table id
SCORE_BYTES = 8
MARK = b"\x00dynamicemb-owner"  # after the prefix: 17 bytes, so never a packed row key
#: The row format of a mark that names none (written before formats were recorded).
UNRECORDED_FORMAT = "float32"
_FORMAT = re.compile(r"[A-Za-z0-9_.+\[\]]+")  # a RowFormat tag: no spaces, no commas
_MARKED_FORMAT = re.compile(rb"rows ([^\s,]+), ")  # how a mark starts that names one


class ExternalStorageError(RuntimeError):
    """An external store failed (unreachable, full, too slow, locked, lost its data,
    owned by another module, or returned a row of the wrong size), named in the message."""


def brief_error(error: BaseException, limit: int = 200) -> str:
    """The error's message, printable, at most ``limit`` characters."""
    text = ascii(str(error))[1:-1]
    return text if len(text) <= limit else text[:limit] + "..."


def marked_format(mark: bytes) -> str:
    """The row format tag a mark records; ``UNRECORDED_FORMAT`` for a mark written
    before formats were recorded (its rows are float32)."""
    found = _MARKED_FORMAT.match(mark)
    return found.group(1).decode() if found else UNRECORDED_FORMAT


def _same_format(recorded: str, mine: str) -> bool:
    """Whether rows recorded as ``recorded`` are rows of format ``mine``: an unrecorded
    format (float32 rows of the store's width) matches every float32 tag."""
    if recorded == UNRECORDED_FORMAT:
        return mine.startswith(UNRECORDED_FORMAT + "[")
    return recorded == mine


def _describe_mark(mark: bytes) -> str:
    """A mark as printable text, cut short."""
    text = ascii(mark.decode("utf-8", "replace"))[1:-1]
    return text if len(text) <= 160 else text[:160] + "..."


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
    """A store of rows of ``row_width`` float32 words by (table id, key), named ``name``
    in messages. Verbs take whole batches of CPU tensors. A backend calls ``claim`` when
    it opens and ``_check_mark`` in every verb's round trip before it writes.

    Args:
        name: the store in messages.
        row_width: 4-byte words of a row (``RowFormat.storage_width``).
        row_format: the rows' layout, ``RowFormat.tag`` (e.g. ``"bfloat16[128]+f32[1]"``),
            recorded in the mark: a module of another format cannot resume the rows.

    Raises:
        ValueError: a width below 1, or a format that is no tag.
    """

    def __init__(self, name: str, row_width: int, row_format: str) -> None:
        if isinstance(row_width, bool) or not isinstance(row_width, int) or row_width <= 0:
            raise ValueError(f"row_width must be a positive int, got {row_width!r}")
        if not isinstance(row_format, str) or not _FORMAT.fullmatch(row_format):
            raise ValueError(f"row_format must be a RowFormat tag such as "
                             f"'bfloat16[128]+f32[1]', got {row_format!r}")
        self.name = name
        self.row_width = row_width
        self.row_format = row_format
        self.value_bytes = SCORE_BYTES + 4 * row_width
        # This store object's mark: its rows' format, then unique per open, readable in
        # another run's message.
        self.mark = (f"rows {row_format}, opened by pid {os.getpid()} on "
                     f"{socket.gethostname()} at "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, "
                     f"owner {uuid.uuid4().hex}").encode()

    # ---------------------------------------------------------- ownership
    def claim(self, resume: bool = False) -> None:
        """Makes this store object the owner of its namespace; ``resume`` takes over
        another store's rows (whose next call fails) when they have this store's row
        format, else they raise ``ExternalStorageError`` (as do rows of another format,
        a lost mark, no connection, a racing claim), changing nothing."""
        try:
            marks = self._read_marks()
            held = [(where, m) for where, m in marks if m is not None]
            other = next(((where, marked_format(m)) for where, m in held
                          if not _same_format(marked_format(m), self.row_format)), None)
            if resume and other is not None:
                raise ExternalStorageError(
                    f"external store {self.name}: resume=True, but {other[0]} holds rows of "
                    f"format {other[1]}" + (" (written before formats were recorded)"
                                            if other[1] == UNRECORDED_FORMAT else "")
                    + f" and this module's rows are {self.row_format}: a module resumes "
                    f"only rows of its own format (embedding dtype, dim and optimizer "
                    f"state). Give this model a run name of its own (run=...) or empty the "
                    f"store ({self._emptying_hint()}), and load a checkpoint (DynamicEmbLoad)")
            if held and not resume:
                raise ExternalStorageError(
                    f"external store {self.name} already holds the rows of another module "
                    f"({_describe_mark(held[0][1])}): a new module starts on an empty store. "
                    f"Continue from those rows with resume=True (the exact way to continue a "
                    f"run is DynamicEmbLoad of its checkpoint, which rebuilds the store), give "
                    f"this model a run name of its own (run=...), or start over: "
                    f"{self._emptying_hint()}")
            if held and len(held) < len(marks):
                lost = [where for where, m in marks if m is None]
                raise ExternalStorageError(
                    f"external store {self.name}: resume=True, but {', '.join(lost)} hold none "
                    f"of the earlier module's rows: they lost their data. {self._emptying_hint()} "
                    f"and load a checkpoint (DynamicEmbLoad) instead")
            if resume and not held:
                logger.warning("external store %s: resume=True, but it holds no rows of an "
                               "earlier module: starting empty", self.name)
            if not self._write_marks(self.mark, replace=resume):
                raise ExternalStorageError(
                    f"external store {self.name}: another module claimed it while this one "
                    f"opened it")
        except ExternalStorageError:
            raise
        except Exception as e:
            raise ExternalStorageError(f"external store {self.name} failed to open: "
                                       f"{type(e).__name__}: {brief_error(e)}") from e

    def _check_mark(self, where: str, mark: Optional[bytes]) -> None:
        """Raises unless ``mark``, read from ``where``, is this store's."""
        if mark == self.mark:
            return
        if mark is None:
            problem = (f"{where} no longer holds this module's rows: it lost its data "
                       f"(e.g. a server restarted without persistence, flushed, or evicting "
                       f"keys)")
        else:
            problem = (f"another module took {where} over (resume=True): "
                       f"{_describe_mark(mark)}")
        raise ExternalStorageError(f"external store {self.name}: {problem}; the call "
                                   f"changed nothing")

    # -------------------------------------------------------------- verbs
    def get(self, keys: torch.Tensor, table_ids: torch.Tensor) -> StoredRows:
        """The stored entries of ``keys`` that the store holds.

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor): (n,) integer local table ids.

        Returns:
            (found, ``StoredRows`` of the found keys in input order): found is (n,) bool.

        Raises:
            ExternalStorageError: a stored value of the wrong length.
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
        """Inserts or overwrites entries.

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
        width = len(self._key_prefix()) + KEY_BYTES
        for keys, values in self._scan(chunk):
            if any(len(k) != width for k in keys):  # the mark is no row
                keep = [len(k) == width for k in keys]
                keys, values = list(compress(keys, keep)), list(compress(values, keep))
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
        """Removes every row of its namespace (the mark stays)."""
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
        """(keys, values) lists of at most ``chunk`` packed entries (the mark may be one)."""

    @abc.abstractmethod
    def _read_marks(self) -> List[Tuple[str, Optional[bytes]]]:
        """(where, mark or None) of each server (or directory) of the namespace."""

    @abc.abstractmethod
    def _write_marks(self, mark: bytes, replace: bool) -> bool:
        """Writes ``mark`` on every server; unless ``replace``, only if none has one
        (else False, writing nothing)."""

    @abc.abstractmethod
    def _emptying_hint(self) -> str:
        """How a user empties this namespace."""

    # ------------------------------------------------------------ packing
    def _key_prefix(self) -> bytes:
        """Bytes put before every packed key (a backend's namespace)."""
        return b""

    def _prefixes(self, keys: torch.Tensor, table_ids: torch.Tensor) -> np.ndarray:
        """(len(prefix),) or (n, len(prefix)) uint8: the bytes before each packed key,
        all as long as ``_key_prefix``."""
        return np.frombuffer(self._key_prefix(), dtype=np.uint8)

    def _pack_keys(self, keys: torch.Tensor, table_ids: torch.Tensor) -> List[bytes]:
        n = keys.numel()
        if table_ids.shape != (n,):
            raise ValueError(f"table_ids must have shape ({n},), got {tuple(table_ids.shape)}")
        prefix = self._prefixes(keys.detach().cpu(), table_ids.detach().cpu())
        width = prefix.shape[-1]
        packed = np.empty((n, width + KEY_BYTES), dtype=np.uint8)
        packed[:, :width] = prefix
        packed[:, width:width + 8] = (
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
        return (f"{type(self).__name__}({self.name!r}, row_width={self.row_width}, "
                f"row_format={self.row_format!r})")


def _columns(packed: np.ndarray, start: int, end: int, dtype: str) -> torch.Tensor:
    """A copy of bytes ``[start, end)`` of each row of ``packed`` (n, b) uint8, as ``dtype``."""
    return torch.from_numpy(packed[:, start:end].copy().view(dtype))


def in_chunks(keys: Iterable[bytes], chunk: int, read) -> Iterator[tuple]:
    """``(keys, read(keys))`` for every ``chunk`` keys of ``keys`` (a backend's scan)."""
    batch: List[bytes] = []
    for key in keys:
        batch.append(key)
        if len(batch) == chunk:
            yield batch, read(batch)
            batch = []
    if batch:
        yield batch, read(batch)


def unpack_keys(keys: Sequence[bytes]):
    """(keys int64, table ids int64) of packed keys (their last ``KEY_BYTES``)."""
    packed = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)[:, -KEY_BYTES:]
    return (_columns(packed, 0, 8, "<i8").reshape(-1),
            _columns(packed, 8, KEY_BYTES, "<i2").reshape(-1).long())
