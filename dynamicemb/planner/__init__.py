"""Planning dynamic tables with TorchRec's planner: constraints that mark them, a
storage estimate of their hash tables, and plans that carry their options."""

from dynamicemb._torchrec import require_torchrec

require_torchrec("dynamicemb.planner")

from dynamicemb.planner.estimators import (DynamicEmbPerfConfig, DynamicEmbStorageEstimator,
                                           dynamic_table_bytes, external_table_bytes)
from dynamicemb.planner.planner import DynamicEmbeddingEnumerator, DynamicEmbeddingShardingPlanner
from dynamicemb.planner.types import (
    DynamicEmbParameterConstraints,
    DynamicEmbParameterSharding,
    resolve_options,
    to_dynamic_sharding,
)

__all__ = [
    "DynamicEmbParameterConstraints",
    "DynamicEmbParameterSharding",
    "DynamicEmbPerfConfig",
    "DynamicEmbStorageEstimator",
    "DynamicEmbeddingEnumerator",
    "DynamicEmbeddingShardingPlanner",
    "dynamic_table_bytes",
    "external_table_bytes",
    "resolve_options",
    "to_dynamic_sharding",
]
