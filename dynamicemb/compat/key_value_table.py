"""The names of upstream's module path ``dynamicemb.key_value_table``: the classes of
upstream's ``module.tables`` (``DynamicEmbStorage``, ``HybridStorage``: the views this
package's ``module.tables`` returns, by layout); upstream's storage internals (its
cache, table state, flat loads) are refused by name with what to use instead
(``docs/MIGRATING.md``)."""

from dynamicemb._upstream import module_getattr
from dynamicemb.embedding.upstream_members import DynamicEmbStorage, HybridStorage

__all__ = ["DynamicEmbStorage", "HybridStorage"]

__getattr__ = module_getattr(
    "dynamicemb.key_value_table",
    lazy={},
    refused=("Storage", "Cache", "DynamicEmbCache", "DynamicEmbTableState", "flush_cache",
             "eval_lookup", "export_keys_values_iter"),
)
