"""Upstream's names in the modules at its paths: imported lazily, or refused with an
``ImportError`` saying what to use instead (``docs/MIGRATING.md``)."""

import importlib
from typing import Any, Callable, Iterable, Mapping

__all__ = ["REFUSED", "REFUSED_MODULES", "module_getattr", "refuse_module"]

_TORCH_DTYPES = "tables take torch dtypes (embedding_dtype: float32, float16 or bfloat16)"
#: The external tier as it is accepted today (``DynamicEmbTableOptions.external_storage``).
_EXTERNAL_STORAGE = ("external storage is supported: external_storage takes a directory path "
                     "(RocksDB), 'redis://host:port' (Redis), 'redis+cluster://host:port,...' "
                     "(Redis Cluster), a RocksDBStorage / RedisStorage / RedisClusterStorage "
                     "spec, or a dynamicemb.KVStore (subclass it for a store of "
                     "your own)")
_STORAGE_INTERFACE = ("upstream's storage and cache classes are not reproduced (module.tables "
                      "is a DynamicEmbStorage or HybridStorage view, by layout): "
                      "DynamicEmbTableOptions' caching and local_hbm_for_values / "
                      "global_hbm_for_values choose where rows live, and " + _EXTERNAL_STORAGE
                      + "; module.tables.export_keys_values(device, batch_size, table_id) and "
                      "module.cache_metrics() read them")
#: Upstream's ``Storage`` (and its type variables): the base class of its external stores.
_STORAGE_BASE = ("upstream's Storage base class is not reproduced, but " + _EXTERNAL_STORAGE
                 + "; local_host_for_values bounds the host store above it")
_OPTIMIZER_CLASSES = ("upstream's per-storage optimizer classes are not reproduced: the "
                      "optimizer is fused_params['optimizer'] (EmbOptimType) or "
                      "DynamicEmbOptimizerArgs; get_optimizer_state_dim(optimizer, dim) gives "
                      "its state columns")
_CHECKPOINT_FILES = ("DynamicEmbDump writes this package's format, not upstream's files "
                     "(docs/CHECKPOINTS.md): read one with dynamicemb.checkpoint, or convert "
                     "upstream's keys/values with import_keys_values")
_SCORE_INTERNALS = ("upstream's score arguments drive its CUDA hash table: score_strategy in "
                    "DynamicEmbTableOptions chooses the rule (one strategy, or upstream's "
                    "compound (TIMESTAMP, LFU), which is LRU_LFU here), ScoredHashTable is "
                    "this package's table, and module.export_admission_counters(table) reads "
                    "admission counters")
#: Upstream's internal modules (hash table, CUDA extension buffers, lookup metadata) ->
#: what to use instead; importing one raises ``ImportError`` with the text.
REFUSED_MODULES: Mapping[str, str] = {
    "scored_hashtable": _SCORE_INTERNALS,
    "extendable_tensor": ("upstream's growable CUDA buffers: tables grow by themselves here "
                          "(init_capacity up to max_capacity)"),
    "index_range_meta": ("upstream's lookup metadata of its CUDA kernels: BatchedDynamicEmbeddingTables"
                         " takes a KeyedJaggedTensor's indices and offsets"),
    "lookup_meta": ("upstream's lookup metadata of its CUDA kernels: BatchedDynamicEmbeddingTables "
                    "takes a KeyedJaggedTensor's indices and offsets"),
}

#: Upstream's names not provided here -> what to use instead (one text per name,
#: whichever of upstream's modules it is imported from).
REFUSED: Mapping[str, str] = {
    "_sharded_table_bucket_layout": ("it is upstream's private helper: "
                                     "get_sharded_table_capacity gives a rank's rows"),
    "BaseDynamicEmbeddingOptimizer": _OPTIMIZER_CLASSES,
    "SGDDynamicEmbeddingOptimizer": _OPTIMIZER_CLASSES,
    "AdamDynamicEmbeddingOptimizer": _OPTIMIZER_CLASSES,
    "AdaGradDynamicEmbeddingOptimizer": _OPTIMIZER_CLASSES,
    "RowWiseAdaGradDynamicEmbeddingOptimizer": _OPTIMIZER_CLASSES,
    "get_optimizer_ckpt_state_dim": ("checkpoints hold the optimizer states of "
                                     "get_optimizer_state_dim(optimizer, dim) unpadded"),
    "pad_optimizer_states_from_checkpoint": "DynamicEmbLoad restores optimizer states as saved",
    "truncate_optimizer_states_for_checkpoint": "DynamicEmbDump saves optimizer states as stored",
    "encode_checkpoint_file_path": _CHECKPOINT_FILES,
    "encode_meta_json_file_path": _CHECKPOINT_FILES,
    "data_type_to_dyn_emb": _TORCH_DTYPES,
    "dyn_emb_to_torch": _TORCH_DTYPES,
    "torch_to_dyn_emb": _TORCH_DTYPES,
    "data_type_to_dtype": "use torchrec.modules.embedding_configs.data_type_to_dtype",
    "string_to_evict_strategy": "use DynamicEmbEvictStrategy(name)",
    "MemoryType": "Counter.memory_usage() takes no memory type and returns all bytes held",
    "COUNTER_TYPE": "admission counts are float64 here (export_admission_counters(name).counts)",
    "torch_dtype_to_np_dtype": "call .numpy() on the exported tensors (keys int64, rows of the table's dtype)",
    "tabulate": "it is upstream's printing helper; format tables with your own code",
    **{name: _STORAGE_INTERFACE
       for name in ("DynamicEmbCache", "DynamicEmbTableState", "flush_cache", "eval_lookup")},
    "export_keys_values_iter": ("module.tables.export_keys_values(device, batch_size, "
                                "table_id) yields upstream's chunks"),
    "assert_tensors_equal": "use torch.testing.assert_close",
    **{name: _STORAGE_INTERFACE for name in ("Cache", "CopyMode")},
    **{name: _STORAGE_BASE for name in ("Storage", "OptionsT", "OptimizerT")},
}


def module_getattr(module: str, lazy: Mapping[str, str],
                   refused: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for ``module``: ``lazy`` maps names to
    ``"package.module:attribute"`` imported on first use; ``refused`` names (keys of
    ``REFUSED``) raise ``ImportError``, other names ``AttributeError``."""
    refused = frozenset(refused)
    unknown = refused - set(REFUSED)
    if unknown:
        raise ValueError(f"no replacement text for {sorted(unknown)}")

    def __getattr__(name: str) -> Any:
        if name in lazy:
            path, _, attribute = lazy[name].partition(":")
            return getattr(importlib.import_module(path), attribute)
        if name in refused:
            raise ImportError(f"{module}.{name} is upstream dynamicemb's and is not provided "
                              f"here: {REFUSED[name]} (docs/MIGRATING.md)", name=name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def refuse_module(module: str) -> None:
    """Raises the ``ImportError`` of upstream's internal module ``module``
    (``dynamicemb.<name>``, ``<name>`` a key of ``REFUSED_MODULES``)."""
    name = module.rpartition(".")[2]
    raise ImportError(f"{module} is upstream dynamicemb's internal module and is not provided "
                      f"here: {REFUSED_MODULES[name]} (docs/MIGRATING.md)", name=module)
