"""The module layer: ``BatchedDynamicEmbeddingTables`` and its physical table groups."""

from dynamicemb.embedding.module import (BatchedDynamicEmbeddingTables, ExportedCounters,
                                         ExportedRows, TableClocks)

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedCounters", "ExportedRows", "TableClocks"]
