"""The module layer: ``BatchedDynamicEmbeddingTables`` and its physical table groups."""

from dynamicemb.embedding.module import BatchedDynamicEmbeddingTables, ExportedRows

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedRows"]
