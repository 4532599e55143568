"""Upstream dynamicemb's module path ``dynamicemb.key_value_table``: the classes of its
``module.tables``.

The code lives in ``dynamicemb.compat.key_value_table``, with the ``__getattr__`` that
refuses upstream's names not provided here; this module only re-exports it
(``docs/MIGRATING.md``).
"""

from dynamicemb.compat.key_value_table import (  # noqa: F401
    DynamicEmbStorage,
    HybridStorage,
    __getattr__,
)

__all__ = [
    "DynamicEmbStorage",
    "HybridStorage",
]
