"""Upstream dynamicemb's module path ``dynamicemb.construct_twin_module``: its test helper
``ConstructTwinModule`` (imports TorchRec).

The code lives in ``dynamicemb.compat.construct_twin_module``; this module only
re-exports it (``docs/MIGRATING.md``).
"""

from dynamicemb.compat.construct_twin_module import (  # noqa: F401
    ConstructTwinModule,
)

__all__ = [
    "ConstructTwinModule",
]
