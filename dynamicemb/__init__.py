"""dynamicemb: TorchRec-compatible dynamic embedding tables on a scored hash table."""

from dynamicemb.embedding import BatchedDynamicEmbeddingTables, ExportedRows
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
    "DynamicEmbCheckMode",
    "DynamicEmbFusedOptimizer",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbOptimType",
    "DynamicEmbOptimizerArgs",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "ExportedRows",
    "FrequencyAdmissionStrategy",
    "ScoredHashTable",
]
