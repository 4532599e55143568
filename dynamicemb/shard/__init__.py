"""TorchRec integration: sharders whose sharded modules run dynamic tables, marked in the
plan (``DynamicEmbParameterSharding``); every other table stays TorchRec's, in the same
module."""

from dynamicemb._torchrec import require_torchrec

require_torchrec("dynamicemb.shard")

from dynamicemb.shard._common import get_dynamic_tables, import_dense_rows
from dynamicemb.shard.dedup import IdCounters
from dynamicemb.shard.embedding import (
    DynamicEmbeddingCollectionSharder,
    ShardedDynamicEmbeddingCollection,
)
from dynamicemb.shard.embeddingbag import (
    DynamicEmbeddingBagCollectionSharder,
    ShardedDynamicEmbeddingBagCollection,
)
from dynamicemb.shard.kernel import DynamicEmbEmbedding, DynamicEmbEmbeddingBag, DynamicEmbKeyedOptimizer
from dynamicemb.shard.replicas import refresh_replicas, replicated_ids
from dynamicemb.shard.stale_replicas import flush_replicas
from dynamicemb.shard.topology import host_ranks, threads_per_rank
from dynamicemb.placement import owner_rank

__all__ = [
    "DynamicEmbEmbedding",
    "DynamicEmbEmbeddingBag",
    "DynamicEmbKeyedOptimizer",
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "IdCounters",
    "ShardedDynamicEmbeddingBagCollection",
    "ShardedDynamicEmbeddingCollection",
    "flush_replicas",
    "get_dynamic_tables",
    "host_ranks",
    "import_dense_rows",
    "owner_rank",
    "refresh_replicas",
    "replicated_ids",
    "threads_per_rank",
]
