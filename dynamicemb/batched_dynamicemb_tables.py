"""Upstream dynamicemb's module path of its table module.

``BatchedDynamicEmbeddingTablesV2`` is ``BatchedDynamicEmbeddingTables`` (the same
class; see ``docs/MIGRATING.md`` for the differences from upstream's).
"""

from dynamicemb.embedding.module import BatchedDynamicEmbeddingTables

__all__ = ["BatchedDynamicEmbeddingTables", "BatchedDynamicEmbeddingTablesV2"]

BatchedDynamicEmbeddingTablesV2 = BatchedDynamicEmbeddingTables
