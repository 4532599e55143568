"""The dynamic tables a rank holds in a model, and which keys it owns of each."""

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from dynamicemb.embedding import BatchedDynamicEmbeddingTables
from dynamicemb.placement import TablePlacement
from dynamicemb.types import DynamicEmbDistType

__all__ = ["LocalTable", "PendingUpdates", "ShardKernel", "dynamic_modules", "local_tables",
           "pending_updates", "shard_kernels", "table_name_list", "unwrap"]


@dataclass
class LocalTable:
    """A dynamic table stored (wholly or in part) on this rank; ``owns(keys)`` is the
    (n,) bool mask of the keys (n,) int64 this rank stores, ``sharding`` ``row_wise``,
    ``table_wise`` or ``unsharded``."""

    name: str
    module: BatchedDynamicEmbeddingTables
    sharding: str
    num_shards: int
    owns: Callable[[torch.Tensor], torch.Tensor]
    dist_type: DynamicEmbDistType
    placement: Optional[TablePlacement] = None


class ShardKernel:
    """What checkpoints ask of a sharded model's kernel of dynamic tables;
    ``dynamicemb.shard``'s kernels derive from it, so this layer imports no TorchRec."""

    @property
    def emb_module(self) -> BatchedDynamicEmbeddingTables:
        """The module holding this rank's rows of the tables."""
        raise NotImplementedError

    def num_shards(self, table_name: str) -> int:
        """Shards of the table: the world size for row-wise, 1 for table-wise."""
        raise NotImplementedError

    def owns(self, table_name: str, keys: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of ``keys`` (n,) int64 this rank stores for the table."""
        raise NotImplementedError

    def dist_type(self, table_name: str) -> DynamicEmbDistType:
        """The table's placement of keys among its shards."""
        raise NotImplementedError

    def placement(self, table_name: str) -> Optional[TablePlacement]:
        """The table's placement file entry (None: every key on its ``dist_type`` owner)."""
        raise NotImplementedError


class PendingUpdates:
    """Updates of owner rows not applied yet (stale hot-row replicas): checkpoints
    flush them before reading rows and drop them before writing rows."""

    def flush_pending(self) -> None:
        """Applies them to the owner rows (a collective: call it on every rank)."""
        raise NotImplementedError

    def drop_pending(self) -> None:
        """Forgets them and the copies of rows, read again when next needed (every rank)."""
        raise NotImplementedError


def pending_updates(module: nn.Module) -> Iterator[PendingUpdates]:
    """Every ``PendingUpdates`` of ``module``, in module order (the same on every rank)."""
    for sharded in module.modules():
        for lookup in getattr(sharded, "_lookups", None) or ():
            if isinstance(lookup, PendingUpdates):
                yield lookup


def shard_kernels(module: nn.Module) -> Iterator[Tuple[str, ShardKernel]]:
    """(table name, kernel) for every dynamic table stored on this rank."""
    for sharded in module.modules():
        # sharded modules keep their lookups in a plain list, not as submodules
        for lookup in getattr(sharded, "_lookups", None) or ():
            for sub in lookup.modules():
                if isinstance(sub, ShardKernel):
                    for name in sub.emb_module.table_names:
                        yield name, sub


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DMP / DDP wrappers."""
    while True:
        if hasattr(model, "_dmp_wrapped_module"):
            model = model._dmp_wrapped_module
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def dynamic_modules(model: nn.Module) -> List[BatchedDynamicEmbeddingTables]:
    """The ``BatchedDynamicEmbeddingTables`` of ``model`` on this rank, each once."""
    found: Dict[int, BatchedDynamicEmbeddingTables] = {}
    for _, kernel in shard_kernels(model):
        found.setdefault(id(kernel.emb_module), kernel.emb_module)
    for module in model.modules():
        if isinstance(module, BatchedDynamicEmbeddingTables):
            found.setdefault(id(module), module)
    return list(found.values())


def _owns_all(keys: torch.Tensor) -> torch.Tensor:
    return torch.ones(keys.shape, dtype=torch.bool)


def table_name_list(table_names: Optional[Union[Sequence[str], Mapping[str, Sequence[str]]]]
                    ) -> Optional[list]:
    """Table names given as names or as upstream's ``{collection path: names}``."""
    if table_names is None:
        return None
    if isinstance(table_names, Mapping):
        return [name for names in table_names.values() for name in names]
    return list(table_names)


def local_tables(model: nn.Module,
                 table_names: Optional[Union[Sequence[str], Mapping[str, Sequence[str]]]] = None
                 ) -> Dict[str, LocalTable]:
    """Every dynamic table of ``model`` on this rank, by name (only ``table_names`` if
    given); ``ValueError`` if two modules hold a table of the same name."""
    found: Dict[str, LocalTable] = {}
    seen = set()

    def add(table: LocalTable) -> None:
        if table.name in found:
            raise ValueError(f"two dynamic tables named {table.name!r} on this rank")
        found[table.name] = table

    for name, kernel in shard_kernels(model):
        seen.add(id(kernel.emb_module))
        shards = kernel.num_shards(name)
        add(LocalTable(name, kernel.emb_module, "row_wise" if shards > 1 else "table_wise",
                       shards, lambda keys, k=kernel, n=name: k.owns(n, keys),
                       kernel.dist_type(name), kernel.placement(name)))
    for module in model.modules():
        if isinstance(module, BatchedDynamicEmbeddingTables) and id(module) not in seen:
            for name, options in zip(module.table_names, module.table_options):
                add(LocalTable(name, module, "unsharded", 1, _owns_all, options.dist_type))
    table_names = table_name_list(table_names)
    if table_names is not None:
        wanted = set(table_names)
        found = {n: t for n, t in found.items() if n in wanted}
    return found


