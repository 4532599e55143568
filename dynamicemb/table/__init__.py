"""The scored hash table layer: (table id, key) -> slot, scores, eviction."""

from dynamicemb.table.scored_hash_table import (
    MAX_TABLES,
    Evicted,
    Exported,
    InsertResult,
    ScoredHashTable,
    TableStats,
    hash_keys,
)

__all__ = [
    "Evicted",
    "Exported",
    "InsertResult",
    "MAX_TABLES",
    "ScoredHashTable",
    "TableStats",
    "hash_keys",
]
