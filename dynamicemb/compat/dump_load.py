"""The names of upstream's module path ``dynamicemb.dump_load``: its checkpoint
functions (``dynamicemb.checkpoint``'s; ``docs/CHECKPOINTS.md``) and its two model
walkers, ``find_sharded_modules`` and ``get_dynamic_emb_module``."""

from typing import List, Tuple

from torch import nn

from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint.tables import dynamic_modules, unwrap
from dynamicemb.embedding import BatchedDynamicEmbeddingTables

__all__ = ["DynamicEmbDump", "DynamicEmbLoad", "find_sharded_modules", "get_dynamic_emb_module"]


def find_sharded_modules(module: nn.Module, path: str = "") -> List[Tuple[str, str, nn.Module]]:
    """TorchRec's sharded collections in a model (upstream's walker).

    Args:
        module: the model, DMP/DDP-wrapped or not.
        path: prefix of the paths returned.

    Returns:
        ``(path, name, sharded)`` for every ``ShardedEmbeddingCollection`` and
        ``ShardedEmbeddingBagCollection``, in module order (not inside one another):
        ``path`` is ``path + "model"`` followed by the module path with wrappers
        left out (``"model.embedding_module"``, the paths of ``incremental_dump``),
        ``name`` its attribute name (``"model"`` for the model itself).
    """
    from dynamicemb._torchrec import require_torchrec  # noqa: PLC0415

    require_torchrec("dynamicemb.dump_load.find_sharded_modules")
    from torchrec.distributed.embedding import ShardedEmbeddingCollection  # noqa: PLC0415
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection  # noqa: PLC0415

    found: List[Tuple[str, str, nn.Module]] = []

    def visit(current: nn.Module, current_path: str, name: str) -> None:
        current = unwrap(current)
        if isinstance(current, (ShardedEmbeddingCollection, ShardedEmbeddingBagCollection)):
            found.append((current_path, name, current))
            return
        for child_name, child in current.named_children():
            visit(child, f"{current_path}.{child_name}", child_name)

    visit(module, path + "model", "model")
    return found


def get_dynamic_emb_module(model: nn.Module) -> List[BatchedDynamicEmbeddingTables]:
    """The dynamic table modules of a model on this rank (upstream's
    ``BatchedDynamicEmbeddingTablesV2``, which is ``BatchedDynamicEmbeddingTables``),
    each once: in a sharded collection (e.g. one ``find_sharded_modules`` returned), a
    DMP-wrapped model, or an unsharded model.

    Returns:
        The modules; ``m.table_names`` names each one's tables and
        ``m.export_keys_values(name, device)`` returns their ``(keys, embeddings)``.
    """
    return dynamic_modules(model)
