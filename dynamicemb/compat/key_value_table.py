"""Upstream's ``dynamicemb.key_value_table``: the classes of ``module.tables``; its storage
internals are refused by name."""

from dynamicemb._upstream import module_getattr
from dynamicemb.embedding.upstream_members import DynamicEmbStorage, HybridStorage

__all__ = ["DynamicEmbStorage", "HybridStorage"]

__getattr__ = module_getattr(
    "dynamicemb.key_value_table",
    lazy={},
    refused=("Storage", "Cache", "DynamicEmbCache", "DynamicEmbTableState", "flush_cache",
             "eval_lookup", "export_keys_values_iter"),
)
