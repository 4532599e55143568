"""Upstream's ``dynamicemb.dump_load``: the checkpoint functions and two model walkers."""

from typing import List, Tuple

from torch import nn

from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint.tables import dynamic_modules, unwrap
from dynamicemb.embedding import BatchedDynamicEmbeddingTables

__all__ = ["DynamicEmbDump", "DynamicEmbLoad", "find_sharded_modules", "get_dynamic_emb_module"]


def find_sharded_modules(module: nn.Module, path: str = "") -> List[Tuple[str, str, nn.Module]]:
    """TorchRec's outermost sharded collections in ``module`` (DMP/DDP-wrapped or not).

    Returns:
        ``(path, name, sharded)`` in module order: ``path`` is ``path + "model"`` and the
        module path without wrappers (``"model.embedding_module"``), ``name`` its
        attribute name (``"model"`` for the model itself).
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
    """The ``BatchedDynamicEmbeddingTables`` of ``model`` (sharded collection, DMP-wrapped
    or unsharded model) on this rank, each once."""
    return dynamic_modules(model)
