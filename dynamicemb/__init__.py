"""dynamicemb: TorchRec-compatible dynamic embedding tables on a scored hash table.

Upstream NVIDIA dynamicemb's public names are here too, and its module paths
(``dynamicemb.optimizer``, ``dynamicemb.incremental_dump``, ``dynamicemb.planner``,
``dynamicemb.shard``, ...): ``docs/MIGRATING.md`` lists what differs.
"""

# Upstream's module path ``dynamicemb.incremental_dump`` (get_score, dumps by
# collection path) is imported first: the package attribute of that name is then
# rebound to the function below, and later imports of the module keep it so.
from dynamicemb import incremental_dump as _upstream_incremental_dump  # noqa: F401
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTablesV2
from dynamicemb.checkpoint import (CheckpointError, DynamicEmbDump, DynamicEmbLoad,
                                   incremental_dump)
from dynamicemb.embedding import (BatchedDynamicEmbeddingTables, ExportedCounters, ExportedRows,
                                  TableClocks)
from dynamicemb.embedding.admission import Counter
from dynamicemb.optimizer import DynamicEmbFusedOptimizer, EmbOptimType, OptimizerArgs
from dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
    DynamicEmbWeightDecayMode,
    FrequencyAdmissionStrategy,
    KVCounter,
)
from dynamicemb.sizing import (BUCKET_ALIGNMENT, DEMB_TABLE_ALIGN_SIZE, align_to_table_size,
                               get_sharded_table_capacity, get_table_value_bytes)
from dynamicemb.storage.external import (ExternalStorageError, KVStore, RedisStorage,
                                         RocksDBStorage)
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbEvictStrategy, DynamicEmbScoreStrategy

__version__ = "0.1.0"

__all__ = [
    "BUCKET_ALIGNMENT",
    "BatchedDynamicEmbeddingTables",
    "BatchedDynamicEmbeddingTablesV2",
    "CheckpointError",
    "Counter",
    "DEMB_TABLE_ALIGN_SIZE",
    "DynamicEmbCheckMode",
    "DynamicEmbDump",
    "DynamicEmbEvictStrategy",
    "DynamicEmbFusedOptimizer",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbLoad",
    "DynamicEmbOptimType",
    "DynamicEmbOptimizerArgs",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "DynamicEmbWeightDecayMode",
    "EmbOptimType",
    "ExportedCounters",
    "ExportedRows",
    "ExternalStorageError",
    "FrequencyAdmissionStrategy",
    "KVCounter",
    "KVStore",
    "OptimizerArgs",
    "RedisStorage",
    "RocksDBStorage",
    "ScoredHashTable",
    "TableClocks",
    "align_to_table_size",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
    "incremental_dump",
]
