"""The scored hash table layer: (table id, key) -> slot, scores, eviction."""

from dynamicemb.table.scored_hash_table import (
    MAX_TABLES,
    PendingInsert,
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
    "PendingInsert",
    "ScoredHashTable",
    "TableStats",
    "hash_keys",
]
