"""The module layer: ``BatchedDynamicEmbeddingTables`` and its physical table groups."""

from dynamicemb.embedding.module import BatchedDynamicEmbeddingTables
from dynamicemb.embedding.padding import pad_lookups
from dynamicemb.embedding.records import ExportedCounters, ExportedRows, TableClocks

__all__ = ["BatchedDynamicEmbeddingTables", "ExportedCounters", "ExportedRows", "TableClocks",
           "pad_lookups"]
