"""Upstream NVIDIA dynamicemb's module paths: the code behind them.

Each of upstream's module paths at the package root (``dynamicemb.dump_load``,
``dynamicemb.incremental_dump``, ``dynamicemb.get_planner``, ...) is a thin module that
re-exports ``dynamicemb.compat.<same name>``: its walkers, its dump keyed by
collection path, its planner call, its serving entry points, its test helper, and
the ``__getattr__`` that refuses upstream's names this package does not provide
(``docs/MIGRATING.md`` lists them). Upstream's users import the root paths; this
package's own code imports neither (``docs/ARCHITECTURE.md``, "Upstream module paths").

Nothing is imported here: ``get_planner``, ``utils`` and ``construct_twin_module``
import TorchRec, which ``import dynamicemb`` does not need.
"""

__all__ = []
