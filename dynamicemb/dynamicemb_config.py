"""Upstream dynamicemb's module path ``dynamicemb.dynamicemb_config``: its configuration
names.

The code lives in ``dynamicemb.compat.dynamicemb_config``, with the ``__getattr__`` that
refuses upstream's names not provided here; this module only re-exports it
(``docs/MIGRATING.md``).
"""

from dynamicemb.compat.dynamicemb_config import (  # noqa: F401
    BATCH_SIZE_PER_DUMP,
    BUCKET_ALIGNMENT,
    DEBUG_EMB_INITIALIZER_MOD,
    DEFAULT_BUCKET_CAPACITY,
    DEMB_TABLE_ALIGN_SIZE,
    DynamicEmbCheckMode,
    DynamicEmbDistType,
    DynamicEmbEvictStrategy,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    SUPPORTED_DIST_TYPES,
    ScoreStrategy,
    align_to_table_size,
    get_sharded_table_capacity,
    get_table_value_bytes,
    __getattr__,
)

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
