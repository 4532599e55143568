"""Upstream dynamicemb's module path ``dynamicemb.get_planner``: its planner call (imports
TorchRec).

The code lives in ``dynamicemb.compat.get_planner``; this module only re-exports it
(``docs/MIGRATING.md``).
"""

from dynamicemb.compat.get_planner import (  # noqa: F401
    PIPELINE_COMPUTE_KERNELS,
    get_planner,
    get_planner_constraints,
)

__all__ = [
    "PIPELINE_COMPUTE_KERNELS",
    "get_planner",
    "get_planner_constraints",
]
