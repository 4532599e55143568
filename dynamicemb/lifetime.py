"""Row lifetime: the TTL sweep of every dynamic table a rank holds in a model."""

from typing import Dict

from torch import nn

from dynamicemb.checkpoint.tables import local_tables

__all__ = ["expire"]


def expire(model: nn.Module) -> Dict[str, int]:
    """Frees, in every tier, the expired rows (``DynamicEmbTableOptions.ttl``) of every
    dynamic table this rank holds in ``model``. Not a collective.

    Args:
        model: a module holding dynamic tables (e.g. a ``DistributedModelParallel``).

    Returns:
        Rows freed on this rank per table name (tables with a ttl only).
    """
    modules = {id(t.module): t.module for t in local_tables(model).values()}
    freed: Dict[str, int] = {}
    for module in modules.values():
        freed.update(module.expire())
    return freed
