"""HugeCTR plan files <-> TorchRec sharding plans: ``load_plan`` / ``PlanFile``, the
generators, ``to_sharding_plan`` / ``from_sharding_plan`` (TorchRec is imported on first use,
so the file tools work without it) and the ``python -m dynamicemb.plan`` command line."""

from dynamicemb.plan.format import LookupPlacement, PlanFile, PlanGroup, load_plan
from dynamicemb.plan.generators import distributed, dp_and_localized, greedy

__all__ = [
    "Lookup",
    "LookupPlacement",
    "PlanFile",
    "PlanGroup",
    "distributed",
    "dp_and_localized",
    "from_sharding_plan",
    "greedy",
    "load_plan",
    "model_lookups",
    "to_sharding_plan",
]

_TRANSLATE = {"Lookup", "from_sharding_plan", "model_lookups", "to_sharding_plan"}


def __getattr__(name: str):
    if name in _TRANSLATE:  # needs TorchRec
        from dynamicemb._torchrec import require_torchrec  # noqa: PLC0415

        require_torchrec(f"dynamicemb.plan.{name}")
        from dynamicemb.plan import translate  # noqa: PLC0415

        return getattr(translate, name)
    raise AttributeError(f"module 'dynamicemb.plan' has no attribute {name!r}")
