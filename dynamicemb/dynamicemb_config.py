"""Upstream dynamicemb's module path of its configuration names (re-exported)."""

from dynamicemb.options import (DynamicEmbInitializerArgs, DynamicEmbInitializerMode,
                                DynamicEmbPoolingMode, DynamicEmbTableOptions)
from dynamicemb.sizing import (BUCKET_ALIGNMENT, DEMB_TABLE_ALIGN_SIZE, align_to_table_size,
                               get_sharded_table_capacity, get_table_value_bytes)
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbEvictStrategy, DynamicEmbScoreStrategy

__all__ = [
    "BUCKET_ALIGNMENT",
    "DEMB_TABLE_ALIGN_SIZE",
    "DynamicEmbCheckMode",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "align_to_table_size",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
]
