"""Upstream's ``dynamicemb.dynamicemb_config`` names; those not provided are refused."""

from dynamicemb._upstream import module_getattr
from dynamicemb.embedding.upstream_members import BATCH_SIZE_PER_DUMP
from dynamicemb.options import (DynamicEmbInitializerArgs, DynamicEmbInitializerMode,
                                DynamicEmbPoolingMode, DynamicEmbTableOptions)
from dynamicemb.sizing import (BUCKET_ALIGNMENT, DEFAULT_BUCKET_CAPACITY, DEMB_TABLE_ALIGN_SIZE,
                               align_to_table_size, get_sharded_table_capacity,
                               get_table_value_bytes)
from dynamicemb.types import (DynamicEmbCheckMode, DynamicEmbDistType, DynamicEmbEvictStrategy,
                              DynamicEmbScoreStrategy, ScoreStrategy)

#: ``DynamicEmbInitializerMode.DEBUG`` fills a new row with ``key % DEBUG_EMB_INITIALIZER_MOD``.
DEBUG_EMB_INITIALIZER_MOD = 100_000
#: The ``dist_type`` values ``DynamicEmbTableOptions`` takes.
SUPPORTED_DIST_TYPES = tuple(d.value for d in DynamicEmbDistType)

__all__ = [
    "BATCH_SIZE_PER_DUMP",
    "BUCKET_ALIGNMENT",
    "DEBUG_EMB_INITIALIZER_MOD",
    "DEFAULT_BUCKET_CAPACITY",
    "DEMB_TABLE_ALIGN_SIZE",
    "DynamicEmbCheckMode",
    "DynamicEmbDistType",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "SUPPORTED_DIST_TYPES",
    "ScoreStrategy",
    "align_to_table_size",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
]

__getattr__ = module_getattr("dynamicemb.dynamicemb_config", lazy={}, refused=(
    "_sharded_table_bucket_layout", "data_type_to_dyn_emb", "dyn_emb_to_torch",
    "torch_to_dyn_emb", "data_type_to_dtype", "string_to_evict_strategy"))
