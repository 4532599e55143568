"""Upstream dynamicemb's module path ``dynamicemb.key_value_table``: the classes of
upstream's ``module.tables`` (``DynamicEmbStorage``, ``HybridStorage``: the views this
package's ``module.tables`` returns, by layout); upstream's storage internals (its
cache, table state, flat loads) are refused by name with what to use instead
(``docs/MIGRATING.md``)."""

from dynamicemb._upstream import module_getattr

__all__ = ["DynamicEmbStorage", "HybridStorage"]

__getattr__ = module_getattr(
    __name__,
    lazy={
        "DynamicEmbStorage": "dynamicemb.embedding.upstream_members:DynamicEmbStorage",
        "HybridStorage": "dynamicemb.embedding.upstream_members:HybridStorage",
    },
    refused=("Storage", "Cache", "DynamicEmbCache", "DynamicEmbTableState", "flush_cache",
             "eval_lookup", "export_keys_values_iter"),
)
