"""Upstream dynamicemb's module path ``dynamicemb.incremental_dump``: ``get_score``,
``set_score`` and the dump keyed by collection path.

The code lives in ``dynamicemb.compat.incremental_dump``; this module only re-exports it
(``docs/MIGRATING.md``).
"""

from dynamicemb.compat.incremental_dump import (  # noqa: F401
    get_score,
    incremental_dump,
    set_score,
)

__all__ = [
    "get_score",
    "incremental_dump",
    "set_score",
]
