"""Upstream dynamicemb's module path ``dynamicemb.dump_load``: its checkpoint functions and
model walkers.

The code lives in ``dynamicemb.compat.dump_load``; this module only re-exports it
(``docs/MIGRATING.md``).
"""

from dynamicemb.compat.dump_load import (  # noqa: F401
    DynamicEmbDump,
    DynamicEmbLoad,
    find_sharded_modules,
    get_dynamic_emb_module,
)

__all__ = [
    "DynamicEmbDump",
    "DynamicEmbLoad",
    "find_sharded_modules",
    "get_dynamic_emb_module",
]
