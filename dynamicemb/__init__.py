"""dynamicemb: TorchRec-compatible dynamic embedding tables on a scored hash table."""

from dynamicemb.checkpoint import (CheckpointError, DynamicEmbDump, DynamicEmbLoad,
                                   incremental_dump)
from dynamicemb.embedding import (BatchedDynamicEmbeddingTables, ExportedCounters, ExportedRows,
                                  TableClocks)
from dynamicemb.optimizer import DynamicEmbFusedOptimizer
from dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
)
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__version__ = "0.1.0"

__all__ = [
    "BatchedDynamicEmbeddingTables",
    "CheckpointError",
    "DynamicEmbCheckMode",
    "DynamicEmbDump",
    "DynamicEmbFusedOptimizer",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbLoad",
    "DynamicEmbOptimType",
    "DynamicEmbOptimizerArgs",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "ExportedCounters",
    "ExportedRows",
    "FrequencyAdmissionStrategy",
    "ScoredHashTable",
    "TableClocks",
    "incremental_dump",
]
