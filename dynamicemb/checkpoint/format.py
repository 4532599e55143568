"""The on-disk format of a checkpoint (``docs/CHECKPOINTS.md``): ``manifest.json`` and,
per table and saving rank, one headerless little-endian file per field, whose dtype,
shape, size and CRC-32 the manifest gives.

The embeddings file has the table's row dtype; numpy has no bfloat16, so a bfloat16
table's file holds the bfloat16 bits as ``"<u2"`` (the only field of that dtype), which
``FieldReader`` reads back as bfloat16.
"""

import dataclasses
import enum
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Dict, List, Optional
from urllib.parse import quote

import numpy as np
import torch

__all__ = [
    "EMBEDDING_FILE_DTYPES",
    "FIELD_DTYPES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointError",
    "FieldReader",
    "FieldWriter",
    "FileEntry",
    "Manifest",
    "ShardEntry",
    "TableEntry",
    "field_file_name",
    "jsonable",
    "verify_file",
]

FORMAT_NAME = "dynamicemb-checkpoint"
FORMAT_VERSION = 1

#: Every field file's dtype (numpy notation, little-endian) but the embeddings'.
FIELD_DTYPES = {
    "keys": "<i8",
    "optimizer_states": "<f4",
    "scores": "<i8",
    "counter_keys": "<i8",
    "counter_counts": "<f8",
    "counter_scores": "<i8",
}

#: The embeddings file's dtype by the table's row dtype (``TableEntry.embedding_dtype``):
#: bfloat16 rows as their bits, ``"<u2"``.
EMBEDDING_FILE_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
#: The file dtype whose values are bfloat16 bits.
_BFLOAT16_BITS = np.dtype("<u2")

_READ_BLOCK = 8 << 20  # bytes per read when verifying a file


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read: what is wrong and which file."""


def field_file_name(table: str, rank: int, field_name: str) -> str:
    """``<table>.rank<rank>.<field>.bin``, the table name percent-encoded."""
    return f"{quote(table, safe='')}.rank{rank:05d}.{field_name}.bin"


def jsonable(value: Any) -> Any:
    """Options as JSON: dataclasses as dicts, enums by value, dtypes by name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


@dataclass
class FileEntry:
    """One field file of a shard: its name in the version, numpy dtype string, shape
    (rows, or rows and columns), exact size and ``zlib.crc32``."""

    file: str
    dtype: str
    shape: List[int]
    bytes: int
    crc32: int


@dataclass
class ShardEntry:
    """The rows one rank held of a table: counts, its ``TableClocks``, its module's
    ``train_steps`` and its files by field name."""

    rank: int
    rows: int
    counter_rows: int
    optimizer_step: int
    score_clock: int
    admission_clock: int
    train_steps: int
    files: Dict[str, FileEntry] = field(default_factory=dict)


@dataclass
class TableEntry:
    """A saved table.

    Attributes:
        state_dim: optimizer-state columns per row (0 when states were not saved).
        optimizer, options: ``DynamicEmbOptimizerArgs`` and (informative) the rank's
            ``DynamicEmbTableOptions`` as JSON.
        shards: one ``ShardEntry`` per rank that held rows of it.
        dist_type: the placement of its keys on the shards (``hash`` when absent:
            older manifests, whatever their ``options.dist_type`` says).
        placement: ``{"file", "sha256", "world_size", "ids"}`` of the table's placement
            file, or None (informative: a load routes rows as the loading model does).
        embedding_dtype: the saved rows' dtype (``ROW_DTYPE_NAMES``), which the
            embeddings files have (``EMBEDDING_FILE_DTYPES``). Absent means float32: the
            manifest of a float32 table leaves it out, as manifests did before 16-bit
            rows, so that it stays readable by those versions (which refuse a 16-bit
            table's manifest for the unknown field instead of misreading its files).
    """

    dim: int
    state_dim: int
    optimizer: Dict[str, Any]
    score_strategy: str
    options: Dict[str, Any]
    sharding: str
    num_shards: int
    rows: int
    optim: bool
    counter: bool
    shards: List[ShardEntry] = field(default_factory=list)
    dist_type: str = "hash"
    placement: Optional[Dict[str, Any]] = None
    embedding_dtype: str = "float32"


@dataclass
class Manifest:
    """``manifest.json``: what a checkpoint version holds."""

    world_size: int
    tables: Dict[str, TableEntry]
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    byte_order: str = "little"

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        for table in raw["tables"].values():
            if table["embedding_dtype"] == "float32":  # see TableEntry.embedding_dtype
                del table["embedding_dtype"]
        return json.dumps(raw, indent=1, sort_keys=True)

    @classmethod
    def read(cls, path: str) -> "Manifest":
        """Parses and checks ``path``; raises ``CheckpointError``."""
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing manifest") from None
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: not a JSON manifest ({err})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path}: not a {FORMAT_NAME} manifest")
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: format_version {raw.get('format_version')!r}; this dynamicemb "
                f"reads version {FORMAT_VERSION}")
        try:
            tables = {}
            for name, t in raw["tables"].items():
                shards = [ShardEntry(**{**s, "files": {k: FileEntry(**v) for k, v in s["files"].items()}})
                          for s in t["shards"]]
                tables[name] = TableEntry(**{**t, "shards": shards})
                _check_embeddings_files(path, name, tables[name])
            return cls(world_size=raw["world_size"], tables=tables, format=raw["format"],
                       format_version=raw["format_version"], byte_order=raw["byte_order"])
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{path}: malformed manifest ({err!r})") from None


def _check_embeddings_files(path: str, name: str, table: TableEntry) -> None:
    """Raises ``CheckpointError`` unless the table's dtype is known and its embeddings
    files have that dtype's file dtype."""
    expected = EMBEDDING_FILE_DTYPES.get(table.embedding_dtype)
    if expected is None:
        raise CheckpointError(f"{path}: table {name!r} has embedding_dtype "
                              f"{table.embedding_dtype!r}; this dynamicemb reads "
                              f"{sorted(EMBEDDING_FILE_DTYPES)}")
    for shard in table.shards:
        entry = shard.files.get("embeddings")
        if entry is not None and entry.dtype != expected:
            raise CheckpointError(f"{path}: table {name!r} rank {shard.rank}: embeddings file "
                                  f"of dtype {entry.dtype!r}, its {table.embedding_dtype} rows "
                                  f"are stored as {expected!r}")


class FieldWriter:
    """Appends chunks of one field to its file, counting bytes and the CRC-32;
    ``columns`` per row (0: a 1-D field)."""

    def __init__(self, directory: str, name: str, dtype: str, columns: int) -> None:
        self.name, self.dtype, self.columns = name, dtype, columns
        self.rows = 0
        self._crc = 0
        self._bytes = 0
        self._file: BinaryIO = open(os.path.join(directory, name), "wb")

    def write(self, chunk: torch.Tensor) -> None:
        """Appends ``chunk``: (m,) or (m, columns), converted to the field's dtype; a
        bfloat16 chunk (a ``"<u2"`` field only) as its bits."""
        chunk = chunk.detach().cpu()
        bits = np.dtype(self.dtype) == _BFLOAT16_BITS
        if bits != (chunk.dtype == torch.bfloat16):
            raise ValueError(f"{self.name}: a {self.dtype!r} field takes "
                             f"{'only' if bits else 'no'} bfloat16 values, got {chunk.dtype}")
        if bits:
            chunk = chunk.view(torch.uint16)
        array = np.ascontiguousarray(chunk.numpy(), dtype=np.dtype(self.dtype))
        if array.size == 0:
            return
        data = memoryview(array.reshape(-1)).cast("B")
        self._file.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._bytes += len(data)
        self.rows += array.shape[0]

    def close(self) -> FileEntry:
        """Flushes and fsyncs the file; returns its manifest entry."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        shape = [self.rows, self.columns] if self.columns else [self.rows]
        return FileEntry(self.name, self.dtype, shape, self._bytes, self._crc)

    def discard(self) -> None:
        self._file.close()


def verify_file(directory: str, entry: FileEntry) -> Optional[str]:
    """None if the file has the entry's size and CRC-32; else what is wrong."""
    path = os.path.join(directory, entry.file)
    expected = int(np.prod(entry.shape, dtype=np.int64)) * np.dtype(entry.dtype).itemsize
    if expected != entry.bytes:
        return f"{path}: manifest says {entry.bytes} bytes for shape {entry.shape} of {entry.dtype}"
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"{path}: missing file"
    if size != entry.bytes:
        return f"{path}: {size} bytes, the manifest says {entry.bytes} (truncated or altered)"
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            crc = zlib.crc32(block, crc)
    if crc != entry.crc32:
        return f"{path}: checksum mismatch (crc32 {crc:#010x}, manifest {entry.crc32:#010x})"
    return None


class FieldReader:
    """Reads one field file (``entry`` verified before) in consecutive chunks of rows; a
    ``"<u2"`` file's values are bfloat16 bits, read as bfloat16."""

    def __init__(self, directory: str, entry: FileEntry) -> None:
        self.dtype = np.dtype(entry.dtype)
        self.columns = entry.shape[1] if len(entry.shape) == 2 else 0
        self.rows = entry.shape[0]
        self._file: BinaryIO = open(os.path.join(directory, entry.file), "rb")

    def read(self, rows: int) -> torch.Tensor:
        """The next ``rows`` rows (fewer at the end): (m,) or (m, columns)."""
        width = max(self.columns, 1)
        array = np.fromfile(self._file, dtype=self.dtype, count=rows * width)
        if self.columns:
            array = array.reshape(-1, self.columns)
        values = torch.from_numpy(array.astype(self.dtype.newbyteorder("="), copy=False))
        return values.view(torch.bfloat16) if self.dtype == _BFLOAT16_BITS else values

    def close(self) -> None:
        self._file.close()
