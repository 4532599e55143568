"""Dynamic tables in a DMP state dict, saved and loaded by ``torch.distributed.checkpoint``.

A sharded module's ``state_dict()`` holds, beside each dynamic table's empty
placeholder ``<table>.weight``, an entry ``<table>.dynamic_state``: a
``DynamicTableState`` that DCP saves as one int64 tensor of records (a header
with the clocks, then one record per row and per admission counter) and loads
into whatever world size and sharding the loading model has (each rank keeps the
rows its placement gives it, as ``DynamicEmbLoad`` does). ``docs/CHECKPOINTS.md``
describes the format and its memory.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dynamicemb.checkpoint.records import (VIRTUAL_COLUMNS, VIRTUAL_ROWS, RecordLayout,
                                           TableLoad, export_records)

__all__ = ["DynamicTableState", "STATE_SUFFIX", "register_state_hooks"]

#: Key of a dynamic table's entry: ``<container>.<table>`` + this.
STATE_SUFFIX = ".dynamic_state"
#: Records per chunk DCP writes and reads (the loading memory bound).
CHUNK_RECORDS = 1 << 16


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
        layout = self.target.record_layout
        if dim != 1 or start != 0 or length != layout.columns:
            raise ValueError(
                f"dynamic table {self.target.load.name!r}: saved records have {length} columns, "
                f"this table's have {layout.columns} ({layout.describe()}); load with the "
                f"same dim and optimizer, or use DynamicEmbLoad(optim=False)")
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
    """The state dict entry of one dynamic table on this rank (an empty tensor to
    every other code).

    ``torch.distributed.checkpoint.save`` writes the rank's records in chunks of
    ``CHUNK_RECORDS`` (exported when DCP plans the save: one copy of the rank's
    rows until DCP has taken the last chunk); ``torch.distributed.checkpoint.load``
    empties the table when it plans the load, then imports each chunk it reads
    (keeping the keys this rank owns) and restores the clocks. Pickling it
    (``torch.save`` of the state dict) gives an empty tensor when the table is in
    a ``DynamicEmbDump`` (unchanged since the last dump or ``DynamicEmbLoad``), and
    raises ``RuntimeError`` naming the table otherwise.

    Attributes:
        table: the table's name.
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
        if self.kernel.emb_module.saved:  # in a DynamicEmbDump: an empty tensor stands for it
            return torch.empty(0, dtype=torch.int64).__reduce_ex__(protocol)
        raise RuntimeError(
            f"dynamic table {self.table!r} changed since its last DynamicEmbDump/DynamicEmbLoad "
            f"and a pickled DMP state dict cannot carry it: save the state dict with "
            f"torch.distributed.checkpoint (dcp.save), or call dynamicemb.DynamicEmbDump "
            f"first (docs/CHECKPOINTS.md)")

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
        self._load.begin()
        return [ChunkStorageMetadata(offsets=torch.Size([0, 0]),
                                     sizes=torch.Size([VIRTUAL_ROWS, VIRTUAL_COLUMNS]))]


def _place(kernel: nn.Module, table: str, count: int) -> Tuple[int, int]:
    """(this rank's first record, records over all ranks) of a table: the ranks of a
    row-wise table pack their records in rank order."""
    if kernel.num_shards(table) == 1:
        return 0, count
    counts: List[Optional[int]] = [None] * dist.get_world_size(kernel._pg)
    dist.all_gather_object(counts, count, group=kernel._pg)
    rank = dist.get_rank(kernel._pg)
    return sum(counts[:rank]), sum(counts)


def register_state_hooks(sharded: nn.Module, container: str) -> None:
    """Adds ``<container>.<table>.dynamic_state`` entries to ``sharded``'s state
    dicts, and takes them out of a state dict before TorchRec loads it."""
    from dynamicemb.shard._common import dynamic_kernels  # _common imports the kernels

    def add_entries(module: nn.Module, destination: Dict[str, Any], prefix: str, _meta) -> None:
        for name, kernel in dynamic_kernels(module):
            destination[f"{prefix}{container}.{name}{STATE_SUFFIX}"] = DynamicTableState(name, kernel)

    def drop_entries(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args) -> None:
        for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(STATE_SUFFIX)]:
            del state_dict[key]  # loaded by DCP already (see DynamicTableState)

    sharded._register_state_dict_hook(add_entries)
    sharded._register_load_state_dict_pre_hook(drop_entries, with_module=True)
