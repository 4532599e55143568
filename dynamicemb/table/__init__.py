"""The scored hash table layer: (table id, key) -> slot, scores, eviction."""

from dynamicemb.table.scored_hash_table import (
    MAX_TABLES,
    Deduplicated,
    Evicted,
    Exported,
    InsertResult,
    PendingInsert,
    ScoredHashTable,
    TableStats,
    hash_keys,
)

__all__ = [
    "Deduplicated",
    "Evicted",
    "Exported",
    "InsertResult",
    "MAX_TABLES",
    "PendingInsert",
    "ScoredHashTable",
    "TableStats",
    "hash_keys",
]
