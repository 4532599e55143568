"""Which rank stores a key of a row-wise dynamic table (torch only, no TorchRec import).

Every router and ownership check asks ``owner_rank``, so a key is looked up, trained, saved
and restored on the same rank: ``uint64(placement_word(key, dist_type)) % W``, unless a
placement file (``write_placement``; ``DynamicEmbTableOptions.placement``) places the key.
"""

import hashlib
import os
import zipfile
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from dynamicemb.types import DynamicEmbDistType

__all__ = ["DynamicEmbDistType", "PlacementFile", "TablePlacement", "fmix64", "load_placement",
           "owner_rank", "placement_record", "placement_word", "splitmix64", "table_placement",
           "write_placement"]

_MASK = [(1 << (64 - s)) - 1 for s in range(64)]


def _shift_right_logical(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & _MASK[s]


def _signed(constant: int) -> int:
    """A 64-bit multiplier as the int64 with the same bits (products wrap)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


def splitmix64(keys: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (Stafford's Mix13): (n,) int64 (or int32) keys -> (n,) int64
    words (read as unsigned); bijective.

    Not the table's bucket hash (``dynamicemb.table.hash_keys``), whose low bits pick buckets:
    routing by it would leave each rank only 1/W of its buckets usable.
    """
    return _mix(keys, (30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def fmix64(keys: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer, upstream's ``hash_roundrobin`` hash; as ``splitmix64``."""
    return _mix(keys, (33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53))


def _mix(keys: torch.Tensor, shifts, multipliers) -> torch.Tensor:
    """The xorshift-multiply finalizer both hashes share (64-bit wrapping, logical shifts)."""
    x = keys.to(torch.int64)
    for shift, multiplier in zip(shifts, multipliers):
        x = x ^ _shift_right_logical(x, shift)
        x = x * _signed(multiplier)
    return x ^ _shift_right_logical(x, shifts[-1])


def placement_word(keys: torch.Tensor, dist_type: Union[DynamicEmbDistType, str]) -> torch.Tensor:
    """(n,) int64 word whose unsigned value mod ``W`` is each (n,) int64 (or int32) key's owner:
    ``splitmix64(key)`` (``hash``), the key itself (``roundrobin``) or ``fmix64(key)``
    (``hash_roundrobin``); ``dist_type`` is a ``DynamicEmbDistType`` or its value."""
    dist_type = DynamicEmbDistType(dist_type)
    if dist_type == DynamicEmbDistType.HASH:
        return splitmix64(keys)
    if dist_type == DynamicEmbDistType.HASH_ROUNDROBIN:
        return fmix64(keys)
    return keys.to(torch.int64)


def owner_rank(keys: torch.Tensor, world_size: int,
               dist_type: Union[DynamicEmbDistType, str] = DynamicEmbDistType.HASH,
               placement: Optional["TablePlacement"] = None) -> torch.Tensor:
    """The rank that stores each key of a row-wise dynamic table: its rank in ``placement`` if
    the file places it, else ``uint64(placement_word(key, dist_type)) % world_size``.

    Args:
        keys (Tensor): (n,) int64.
        world_size: number of shards (ranks) of the table.
        dist_type: the table's ``DynamicEmbTableOptions.dist_type``.
        placement: the table's ``TablePlacement``, or None.

    Returns:
        (n,) int64 ranks in ``[0, world_size)``. ``ValueError`` on ``world_size`` < 1, an
        unknown ``dist_type``, or a placement made for another world size.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    word = placement_word(keys, dist_type)
    # uint64 % W with int64 ops: (2 * (w >>> 1) + (w & 1)) % W
    owner = ((_shift_right_logical(word, 1) % world_size) * 2 + (word & 1)) % world_size
    if placement is None:
        return owner
    placement.check(placement.table, world_size)
    ranks, placed = placement.lookup(keys)
    return torch.where(placed, ranks, owner)


# --- placement files: ids placed on chosen ranks, every other id on its hash owner --------

#: ``format`` entry of a placement file, and the version this code reads and writes.
PLACEMENT_FORMAT = "dynamicemb-placement"
PLACEMENT_VERSION = 1


@dataclass(frozen=True)
class TablePlacement:
    """One table's placed ids and their ranks, from the file at ``path`` (hex ``sha256``).

    Attributes:
        ids: (n,) int64, strictly increasing.
        ranks: (n,) int64 in ``[0, world_size)``, the rank of each id.
        replicated: (m,) int64 strictly increasing, the ids the partition left to hot-row
            replicas (``refresh_replicas(model, ids)``); not placed: their owner is the
            ``dist_type`` one.
    """

    table: str
    ids: torch.Tensor
    ranks: torch.Tensor
    world_size: int
    path: str
    sha256: str
    replicated: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def lookup(self, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(ranks, placed)`` of (n,) int64 keys: (n,) int64 placed ranks (meaningful where placed)
        and (n,) bool, whether the file places the key."""
        keys = keys.to(torch.int64)
        if self.ids.numel() == 0:
            return torch.zeros_like(keys), torch.zeros(keys.shape, dtype=torch.bool)
        at = torch.searchsorted(self.ids, keys).clamp_(max=self.ids.numel() - 1)
        return self.ranks[at], self.ids[at] == keys

    def check(self, table: str, world_size: int) -> None:
        """Refuses (``ValueError``) this placement for a table sharded over another world size."""
        if world_size != self.world_size:
            raise ValueError(
                f"placement file {self.path!r} places ids over {self.world_size} ranks, table "
                f"{table!r} is sharded over {world_size}: partition for {world_size} ranks "
                f"(python examples/dlrm/partition.py --world-size {world_size}) or drop the "
                f"table's placement option (keys then go to their dist_type owner)")


@dataclass(frozen=True)
class PlacementFile:
    """A placement file's contents: ``world_size`` and a ``TablePlacement`` per table."""

    path: str
    world_size: int
    tables: Dict[str, TablePlacement]

    def table(self, name: str) -> TablePlacement:
        """The placement of table ``name``; ``ValueError`` naming the file's tables if absent."""
        if name not in self.tables:
            raise ValueError(f"placement file {self.path!r} has no table {name!r} (it places "
                             f"{sorted(self.tables)}); partition with the model's table names "
                             f"or drop the table's placement option")
        return self.tables[name]


def write_placement(path: str, world_size: int, tables: Mapping[str, Tuple[torch.Tensor, torch.Tensor]],
                    replicated: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    """Writes a placement file: an ``.npz`` without pickled objects holding ``format``,
    ``version``, ``world_size``, ``tables`` (the names) and, per table ``i``, ``ids_<i>``
    (sorted int64), ``ranks_<i>`` (int64) and, if given, ``replicated_<i>`` (sorted int64).

    Args:
        path: the file to write (numpy appends ``.npz`` if missing).
        tables: ``{table name: (ids (n,), ranks (n,))}``, ids unique, any order.
        replicated: ``{table name: ids (m,)}`` left to hot-row replicas, unique, any order.

    Raises:
        ValueError: repeated ids, ranks outside ``[0, world_size)``, or replicated ids of a
            table not in ``tables``.
    """
    arrays = {"format": np.array(PLACEMENT_FORMAT), "version": np.array(PLACEMENT_VERSION),
              "world_size": np.array(world_size, np.int64), "tables": np.array(list(tables), dtype=str)}
    unknown = sorted(set(replicated or {}) - set(tables))
    if unknown:
        raise ValueError(f"placement file {path!r}: replicated ids of tables {unknown} the file "
                         f"does not place (tables: {sorted(tables)})")
    for i, (name, (ids, ranks)) in enumerate(tables.items()):
        ids, ranks = torch.as_tensor(ids, dtype=torch.int64), torch.as_tensor(ranks, dtype=torch.int64)
        order = torch.argsort(ids)
        ids, ranks = ids[order], ranks[order]
        _check_table(path, name, ids, ranks, world_size)
        arrays[f"ids_{i}"], arrays[f"ranks_{i}"] = ids.numpy(), ranks.numpy()
        if replicated is not None and name in replicated:
            hot = torch.sort(torch.as_tensor(replicated[name], dtype=torch.int64).reshape(-1)).values
            _check_replicated(path, name, hot)
            arrays[f"replicated_{i}"] = hot.numpy()
    np.savez(path, **arrays)


def _check_replicated(path: str, name: str, ids: torch.Tensor) -> None:
    if ids.dim() != 1 or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise ValueError(f"placement file {path!r}, table {name!r}: replicated ids are not a "
                         f"sorted 1-D array of unique ids; rewrite the file with write_placement")


def _check_table(path: str, name: str, ids: torch.Tensor, ranks: torch.Tensor, world_size: int) -> None:
    where = f"placement file {path!r}, table {name!r}"
    if ids.dim() != 1 or ranks.shape != ids.shape:
        raise ValueError(f"{where}: ids {tuple(ids.shape)} and ranks {tuple(ranks.shape)} must be "
                         f"two 1-D arrays of one length; rewrite the file with write_placement")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: ids are not sorted and unique (an id placed twice?); "
                         f"rewrite the file with write_placement")
    bad = (ranks < 0) | (ranks >= world_size)
    if bool(bad.any()):
        raise ValueError(f"{where}: {int(bad.sum())} ranks outside [0, world_size={world_size}) "
                         f"(e.g. {int(ranks[bad][0])}); rewrite the file for {world_size} ranks")


_CACHE: Dict[Tuple[str, int, int], PlacementFile] = {}


def load_placement(path: Union[str, "os.PathLike[str]"]) -> PlacementFile:
    """Reads and checks a placement file, cached by path, size and modification time.

    Raises:
        ValueError: naming the file: missing, unreadable or corrupt, another format or
            version, unsorted or repeated ids, or ranks out of range.
    """
    path = os.fspath(path)
    try:
        stat = os.stat(path)
    except OSError as err:
        raise ValueError(f"placement file {path!r} cannot be read ({err.strerror}); give the "
                         f"path a partition run wrote (python examples/dlrm/partition.py)") from None
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _CACHE:
        _CACHE[key] = _read_placement(path)
    return _CACHE[key]


def _read_placement(path: str) -> PlacementFile:
    with open(path, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"placement file {path!r} is not a readable .npz without pickled "
                         f"objects ({err}); write it again (python examples/dlrm/partition.py)"
                         ) from None
    if str(arrays.get("format", "")) != PLACEMENT_FORMAT:
        raise ValueError(f"{path!r} is not a dynamicemb placement file (no format="
                         f"{PLACEMENT_FORMAT!r} entry); write it with write_placement")
    version = int(arrays.get("version", -1))
    if version != PLACEMENT_VERSION:
        raise ValueError(f"placement file {path!r} has version {version}; this dynamicemb reads "
                         f"version {PLACEMENT_VERSION}: write it again with this version")
    try:
        world_size = int(arrays["world_size"])
        names = [str(n) for n in arrays["tables"].reshape(-1)]
        tables = {}
        for i, name in enumerate(names):
            ids = torch.from_numpy(np.ascontiguousarray(arrays[f"ids_{i}"], np.int64))
            ranks = torch.from_numpy(np.ascontiguousarray(arrays[f"ranks_{i}"], np.int64))
            _check_table(path, name, ids, ranks, world_size)
            hot = torch.from_numpy(np.ascontiguousarray(
                arrays.get(f"replicated_{i}", np.zeros(0, np.int64)), np.int64))
            _check_replicated(path, name, hot)
            tables[name] = TablePlacement(name, ids, ranks, world_size, path, sha256, hot)
    except (KeyError, TypeError) as err:
        raise ValueError(f"placement file {path!r} is corrupt (missing or bad entry {err}); "
                         f"write it again with write_placement") from None
    if world_size < 1 or len(set(names)) != len(names):
        raise ValueError(f"placement file {path!r} is corrupt (world_size {world_size}, tables "
                         f"{names}); write it again with write_placement")
    return PlacementFile(path, world_size, tables)


def table_placement(path: Optional[str], table: str, num_shards: int) -> Optional[TablePlacement]:
    """A sharded table's entry in the placement file at ``path``, checked for ``num_shards``
    ranks; None without a file or with one shard. ``ValueError``: a bad file, no entry for
    ``table``, or another world size."""
    if path is None or num_shards == 1:
        return None
    placement = load_placement(path).table(table)
    placement.check(table, num_shards)
    return placement


def placement_record(placement: Optional[TablePlacement]) -> Optional[Dict[str, object]]:
    """What a checkpoint manifest records of a table's placement (None: none): the
    file's name and SHA-256, its world size and the number of ids it places."""
    if placement is None:
        return None
    return {"file": os.path.basename(placement.path), "sha256": placement.sha256,
            "world_size": placement.world_size, "ids": int(placement.ids.numel())}
