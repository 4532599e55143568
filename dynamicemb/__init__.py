"""dynamicemb: TorchRec-compatible dynamic embedding tables on a scored hash table.

Upstream NVIDIA dynamicemb's public names are here too, and its module paths
(``dynamicemb.optimizer``, ``dynamicemb.incremental_dump``, ``dynamicemb.planner``,
``dynamicemb.shard``, ...): ``docs/MIGRATING.md`` lists what differs.
"""

# Upstream's module path ``dynamicemb.incremental_dump`` (get_score, dumps by
# collection path) is imported first: the package attribute of that name is then
# rebound to the function below, and later imports of the module keep it so.
from dynamicemb import incremental_dump as _upstream_incremental_dump  # noqa: F401
from dynamicemb import clean_exit as _clean_exit
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTablesV2
from dynamicemb.checkpoint import (CheckpointError, DynamicEmbDump, DynamicEmbLoad,
                                   convert_row_dtypes, incremental_dump)
from dynamicemb.embedding import (BatchedDynamicEmbeddingTables, ExportedCounters, ExportedRows,
                                  TableClocks, pad_lookups)
from dynamicemb.embedding.admission import Counter
from dynamicemb.inference import InferenceEmbeddingTables, to_inference
from dynamicemb.lifetime import expire
from dynamicemb.optimizer import DynamicEmbFusedOptimizer, EmbOptimType, OptimizerArgs
from dynamicemb.options import (
    AdmissionStrategy,
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
from dynamicemb.sizing import (BUCKET_ALIGNMENT, DEFAULT_BUCKET_CAPACITY, DEMB_TABLE_ALIGN_SIZE,
                               align_to_table_size, get_sharded_table_capacity,
                               get_table_value_bytes)
from dynamicemb.storage.external import (ExternalStorageError, KVStore, RedisClusterStorage,
                                         RedisStorage, RocksDBStorage)
from dynamicemb.table import ScoredHashTable
from dynamicemb.embedding.upstream_members import BATCH_SIZE_PER_DUMP
from dynamicemb.types import (MAX_BUCKET_CAPACITY, DynamicEmbCheckMode, DynamicEmbDistType,
                              DynamicEmbGradientCheck,
                              DynamicEmbEvictStrategy, DynamicEmbScoreStrategy, ScoreStrategy)
from dynamicemb._upstream import module_getattr as _module_getattr

__version__ = "0.1.0"

# A Gloo job that imported dynamicemb leaves cleanly (docs/ARCHITECTURE.md, "A clean exit").
_clean_exit.install()

__all__ = [
    "AdmissionStrategy",
    "BATCH_SIZE_PER_DUMP",
    "BUCKET_ALIGNMENT",
    "BatchedDynamicEmbeddingTables",
    "BatchedDynamicEmbeddingTablesV2",
    "CheckpointError",
    "Counter",
    "DEFAULT_BUCKET_CAPACITY",
    "DEMB_TABLE_ALIGN_SIZE",
    "DynamicEmbCheckMode",
    "DynamicEmbDistType",
    "DynamicEmbGradientCheck",
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
    "InferenceEmbeddingTables",
    "KVCounter",
    "KVStore",
    "MAX_BUCKET_CAPACITY",
    "OptimizerArgs",
    "RedisClusterStorage",
    "RedisStorage",
    "RocksDBStorage",
    "ScoreStrategy",
    "ScoredHashTable",
    "TableClocks",
    "align_to_table_size",
    "convert_row_dtypes",
    "expire",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
    "incremental_dump",
    "pad_lookups",
    "to_inference",
]

# upstream's names that are not provided: refused by name, with what to use instead
__getattr__ = _module_getattr(__name__, lazy={}, refused=(
    "data_type_to_dyn_emb",
    "dyn_emb_to_torch", "torch_to_dyn_emb", "data_type_to_dtype", "string_to_evict_strategy"))
