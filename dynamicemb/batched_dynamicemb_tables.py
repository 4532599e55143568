"""Upstream dynamicemb's module path ``dynamicemb.batched_dynamicemb_tables``: its table
module (``BatchedDynamicEmbeddingTablesV2`` is ``BatchedDynamicEmbeddingTables``).

The code lives in ``dynamicemb.compat.batched_dynamicemb_tables``, with the
``__getattr__`` that refuses upstream's names not provided here; this module only
re-exports it (``docs/MIGRATING.md``).
"""

from dynamicemb.compat.batched_dynamicemb_tables import (  # noqa: F401
    BatchedDynamicEmbeddingTables,
    BatchedDynamicEmbeddingTablesV2,
    __getattr__,
)

__all__ = [
    "BatchedDynamicEmbeddingTables",
    "BatchedDynamicEmbeddingTablesV2",
]
