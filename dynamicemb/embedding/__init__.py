"""The module layer: ``BatchedDynamicEmbeddingTables`` and its physical table groups."""

from dynamicemb.embedding.module import (BatchedDynamicEmbeddingTables, ExportedCounters,
                                         ExportedRows, TableClocks)
from dynamicemb.embedding.padding import pad_lookups

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedCounters", "ExportedRows", "TableClocks",
           "pad_lookups"]
