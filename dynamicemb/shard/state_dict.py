"""Dynamic tables in a DMP state dict: beside each dynamic table's empty ``<table>.weight``
placeholder, ``<table>.dynamic_state``, a ``DynamicTableState`` that
``torch.distributed.checkpoint`` saves as int64 records and loads into any world size and
sharding (``docs/CHECKPOINTS.md`` has the format)."""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dynamicemb.checkpoint.records import (COUNTER, HEADER, MIN_COLUMNS, ROW, VIRTUAL_COLUMNS,
                                           VIRTUAL_ROWS, RecordLayout, TableLoad, export_records)
from dynamicemb.checkpoint.tables import pending_updates, shard_kernels
from dynamicemb.types import DynamicEmbDistType

__all__ = ["DynamicTableState", "STATE_SUFFIX", "register_state_hooks"]

#: Key of a dynamic table's entry: ``<container>.<table>`` + this.
STATE_SUFFIX = ".dynamic_state"
#: Records per chunk DCP writes and reads (the loading memory bound).
CHUNK_RECORDS = 1 << 16
#: Kind of the record a pickled entry ends with: key = saving rank, score = the
#: table's shards, next word = its ``dist_type`` as an index of ``DIST_TYPE_CODES``
#: (a pickled entry holds one rank's rows; DCP's records have none).
SHARD = 3
#: ``dist_type`` values by their code in the shard record (older entries hold 0: ``hash``).
DIST_TYPE_CODES = (DynamicEmbDistType.HASH, DynamicEmbDistType.ROUNDROBIN,
                   DynamicEmbDistType.HASH_ROUNDROBIN)


class _Filled(torch.Tensor):
    """A chunk buffer DCP copies saved records into; the copy hands them on."""

    on_filled: Callable[[torch.Tensor], None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:  # DCP detaches the target before copying
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_:
            args[0].on_filled(args[0].as_subclass(torch.Tensor))
        return out


class _Rows:
    """DCP's view of a chunk's rows before its columns are chosen (``narrow``)."""

    def __init__(self, target: "_Receiver", rows: int) -> None:
        self.target, self.rows = target, rows

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """A buffer of the saved chunk's width: ``TableLoad.add_records`` compares the
        layout its headers name (dim, state columns, dtype) and its width with the
        table's."""
        if dim != 1 or start != 0:
            raise ValueError(f"dynamic table {self.target.load.name!r}: unexpected narrow of "
                             f"columns {start}:{start + length}")
        buffer = torch.Tensor._make_subclass(
            _Filled, torch.empty(self.rows, length, dtype=torch.int64))
        buffer.on_filled = self.target.load.add_records
        return buffer


class _Receiver:
    """What DCP narrows to the rows and columns of each saved chunk it reads."""

    def __init__(self, layout: RecordLayout, load: TableLoad) -> None:
        self.record_layout, self.load = layout, load

    def size(self, dim: int) -> int:
        return (VIRTUAL_ROWS, VIRTUAL_COLUMNS)[dim]

    def narrow(self, dim: int, start: int, length: int) -> _Rows:
        if dim != 0:
            raise ValueError(f"dynamic table {self.load.name!r}: unexpected narrow of dim {dim}")
        return _Rows(self, length)


class DynamicTableState(torch.Tensor):
    """The state dict entry of one dynamic table on this rank (an empty tensor to other code).

    ``dcp.save`` writes the rank's records in chunks of ``CHUNK_RECORDS`` (exported when DCP
    plans the save, kept until DCP takes the last chunk); ``dcp.load`` empties the table once
    the first chunk it reads has passed the checks (a refused load changes nothing), then
    imports each chunk (keeping the keys this rank owns) and restores the clocks. Pickling it (``torch.save``, ``copy.deepcopy``) gives a plain int64 tensor of this
    rank's records (``torch.load(..., weights_only=True)`` reads it, ``load_state_dict``
    imports it). ``table`` is the table's name.
    """

    size = None  # DCP compares a loading tensor's size() with the saved one; ours is not known

    @staticmethod
    def __new__(cls, table: str, kernel: nn.Module) -> "DynamicTableState":
        entry = torch.Tensor._make_subclass(cls, torch.empty(0, dtype=torch.int64))
        entry.table, entry.kernel = table, kernel
        entry.record_layout = RecordLayout.of(kernel.emb_module, table)
        entry._load = None  # the TableLoad of a dcp.load
        entry._records = None  # the records being saved
        entry._unsent = 0  # chunks DCP has not taken yet
        entry._offset = 0
        return entry

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"DynamicTableState({self.table!r})"

    def __reduce_ex__(self, protocol: int):
        return pickled_records(self.kernel, self.table, self.record_layout).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        """A snapshot of the records, as pickling gives them."""
        return pickled_records(self.kernel, self.table, self.record_layout)

    # ---------------------------------------------------------------- save
    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        self._load = None
        self._records = export_records(self.kernel.emb_module, self.table, self.record_layout)
        self._offset, total = _place(self.kernel, self.table, self._records.shape[0])
        columns = self.record_layout.columns
        items = []
        for start in range(0, self._records.shape[0], CHUNK_RECORDS):
            rows = min(CHUNK_RECORDS, self._records.shape[0] - start)
            offsets = torch.Size([self._offset + start, 0])
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, columns])),
                    properties=TensorProperties(dtype=torch.int64),
                    size=torch.Size([total, columns]))))
        self._unsent = len(items)
        return items

    def __get_tensor_shard__(self, index: MetadataIndex):
        if self._load is not None:  # the target of a load
            return _Receiver(self.record_layout, self._load)
        if self._records is None:
            raise RuntimeError(f"dynamic table {self.table!r}: DCP asked for a chunk already "
                               f"written (this entry serves one dcp.save)")
        start = index.offset[0] - self._offset  # a chunk DCP saves
        chunk = self._records[start:start + CHUNK_RECORDS]
        self._unsent -= 1
        if self._unsent == 0:  # every chunk is in DCP's hands: the copy goes
            self._records = None
        return chunk

    # ---------------------------------------------------------------- load
    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        self._records = None
        kernel, table = self.kernel, self.table
        self._load = TableLoad(kernel.emb_module, table, self.record_layout,
                               lambda keys: kernel.owns(table, keys))
        return [ChunkStorageMetadata(offsets=torch.Size([0, 0]),
                                     sizes=torch.Size([VIRTUAL_ROWS, VIRTUAL_COLUMNS]))]


def _place(kernel: nn.Module, table: str, count: int) -> Tuple[int, int]:
    """(this rank's first record, records over all ranks); row-wise ranks pack in rank order."""
    if kernel.num_shards(table) == 1:
        return 0, count
    counts: List[Optional[int]] = [None] * dist.get_world_size(kernel._pg)
    dist.all_gather_object(counts, count, group=kernel._pg)
    rank = dist.get_rank(kernel._pg)
    return sum(counts[:rank]), sum(counts)


def pickled_records(kernel: nn.Module, table: str, layout: RecordLayout) -> torch.Tensor:
    """A table's records on this rank as a pickled entry holds them: ``export_records``
    followed by one ``SHARD`` record (this rank, the table's shards, its ``dist_type``)."""
    records = export_records(kernel.emb_module, table, layout, spare=1)
    records[-1, :4] = torch.tensor([SHARD, kernel._rank, kernel.num_shards(table),
                                    DIST_TYPE_CODES.index(kernel.dist_type(table))])
    return records


def _check_records(key: str, table: str, kernel: nn.Module, layout: RecordLayout,
                   records: torch.Tensor) -> None:
    """Refuses a pickled entry this rank's table cannot take whole (nothing changes)."""
    where = f"state dict entry {key!r} (dynamic table {table!r})"
    if records.dtype != torch.int64 or records.dim() != 2 or records.shape[1] < MIN_COLUMNS:
        raise ValueError(
            f"{where}: expected ({layout.columns} columns) int64 records of "
            f"{layout.describe()}, got a {records.dtype} tensor of shape {tuple(records.shape)}; "
            f"load a state dict saved from the same model, or use DynamicEmbLoad")
    kind = records[:, 0]
    headers = records[kind == HEADER]
    if headers.shape[0] != 1 or int(kind[0]) != HEADER or int(kind[-1]) != SHARD or not bool(
            ((kind[:-1] == ROW) | (kind[:-1] == COUNTER) | (kind[:-1] == HEADER)).all()):
        raise ValueError(f"{where}: not the records of one rank's table (a header first, "
                         f"then rows and counters, then the saving shard); load a state dict "
                         f"written by torch.save of model.state_dict()")
    rank, shards = records[-1, 1:3].tolist()
    if shards != kernel.num_shards(table) or (shards > 1 and rank != kernel._rank):
        raise ValueError(
            f"{where}: saved by rank {rank} of a table in {shards} shard(s); this rank is "
            f"{kernel._rank} of {kernel.num_shards(table)} shard(s) (a pickled state dict holds "
            f"one rank's rows); load each rank's file into the same rank of the same sharding, "
            f"or reshard with torch.distributed.checkpoint (dcp.save / dcp.load) or "
            f"DynamicEmbDump / DynamicEmbLoad")
    difference = layout.difference(headers[0, 1:3].tolist())
    if difference:
        raise ValueError(
            f"{where}: {difference}; load with the same dim, optimizer and embedding dtype, "
            f"or use DynamicEmbLoad (optim=False, convert_dtype=True)")
    if records.shape[1] != layout.columns:
        raise ValueError(f"{where}: {records.shape[1]} columns, records of "
                         f"{layout.describe()} have {layout.columns}; load a state dict "
                         f"saved from the same model, or use DynamicEmbLoad")
    code = int(records[-1, 3])
    saved = DIST_TYPE_CODES[code].value if 0 <= code < len(DIST_TYPE_CODES) else f"code {code}"
    if shards > 1 and saved != kernel.dist_type(table).value:
        raise ValueError(
            f"{where}: its keys were placed by dist_type={saved!r}, this table's dist_type is "
            f"{kernel.dist_type(table).value!r}; build the table with dist_type={saved!r} to "
            f"load this file, or reshard with torch.distributed.checkpoint (dcp.save / "
            f"dcp.load) or DynamicEmbDump / DynamicEmbLoad")
    keyed = records[(kind == ROW) | (kind == COUNTER), 1]
    foreign = int((~kernel.owns(table, keyed)).sum()) if keyed.numel() else 0
    if foreign:
        raise ValueError(
            f"{where}: {foreign} saved keys belong to another rank in this model's sharding (a "
            f"pickled state dict holds one rank's rows); load it into the sharding and world "
            f"size that saved it, or reshard with torch.distributed.checkpoint (dcp.save / "
            f"dcp.load) or DynamicEmbDump / DynamicEmbLoad")


def import_pickled_entries(module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                           container: str) -> None:
    """Takes every ``<container>.<table>.dynamic_state`` entry out of ``state_dict`` and loads
    it into ``module``'s tables on this rank, checking every entry before any table changes.

    A ``DynamicTableState`` of this table was loaded by ``dcp.load`` already; one of another
    model's table is copied; a plain int64 tensor of records (a pickled state dict) replaces
    the table's rows, and an empty one leaves the table as it is.

    Raises:
        ValueError: naming the entry: a table not stored on this rank, another dim or
            optimizer, or keys another rank owns.
    """
    kernels = {f"{prefix}{container}.{name}{STATE_SUFFIX}": (name, kernel)
               for name, kernel in shard_kernels(module)}
    loads = []
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(STATE_SUFFIX)]:
        entry = state_dict.pop(key)
        if key not in kernels:
            if isinstance(entry, torch.Tensor) and entry.numel():
                raise ValueError(
                    f"state dict entry {key!r} holds rows of a dynamic table this rank does not "
                    f"store in this model (another sharding saved it); load it into the sharding "
                    f"that saved it, or reshard with torch.distributed.checkpoint or "
                    f"DynamicEmbDump / DynamicEmbLoad")
            continue
        table, kernel = kernels[key]
        layout = RecordLayout.of(kernel.emb_module, table)
        if isinstance(entry, DynamicTableState):
            if entry.kernel is kernel:
                continue  # dcp.load filled the table through this entry
            entry = pickled_records(entry.kernel, entry.table, entry.record_layout)
        if not isinstance(entry, torch.Tensor):
            raise ValueError(f"state dict entry {key!r}: expected a tensor of records, got a "
                             f"{type(entry).__name__}")
        if entry.numel() == 0:
            continue
        _check_records(key, table, kernel, layout, entry)
        loads.append((table, kernel, layout, entry))
    for table, kernel, layout, records in loads:
        load = TableLoad(kernel.emb_module, table, layout,
                         lambda keys, kernel=kernel, table=table: kernel.owns(table, keys))
        records = records[:-1]  # the shard record: checked
        for start in range(0, records.shape[0], CHUNK_RECORDS):
            load.add_records(records[start:start + CHUNK_RECORDS])


def register_state_hooks(sharded: nn.Module, container: str) -> None:
    """Adds ``<container>.<table>.dynamic_state`` entries to ``sharded``'s state dicts and
    loads them before TorchRec loads the rest. Stale replicas' pending gradients are applied
    before a state dict is taken (a collective then) and dropped before one is loaded."""
    def add_entries(module: nn.Module, destination: Dict[str, Any], prefix: str, _meta) -> None:
        for pending in pending_updates(module):
            pending.flush_pending()
        for name, kernel in shard_kernels(module):
            destination[f"{prefix}{container}.{name}{STATE_SUFFIX}"] = DynamicTableState(name, kernel)

    def load_entries(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args) -> None:
        for pending in pending_updates(module):
            pending.drop_pending()
        import_pickled_entries(module, state_dict, prefix, container)

    sharded._register_state_dict_hook(add_entries)
    sharded._register_load_state_dict_pre_hook(load_entries, with_module=True)
