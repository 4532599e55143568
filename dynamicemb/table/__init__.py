"""The scored hash table layer: (table id, key) -> slot, scores, eviction."""

from dynamicemb.table.pending import PendingInsert
from dynamicemb.table.results import (Deduplicated, Entries, InsertResult, TableStats,
                                      expired_hits)
from dynamicemb.table.scored_hash_table import MAX_TABLES, ScoredHashTable, hash_keys

__all__ = [
    "Deduplicated",
    "Entries",
    "InsertResult",
    "MAX_TABLES",
    "PendingInsert",
    "ScoredHashTable",
    "TableStats",
    "expired_hits",
    "hash_keys",
]
