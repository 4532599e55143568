"""Which copy of the CPU kernels this process runs: ``setup.py`` builds ``csrc/cpu`` per
x86-64 level (``_C_x86_64_v4``: AVX-512; ``_C_x86_64_v3``: AVX2, FMA; ``_C_baseline``:
SSE2) or once as ``_C_local`` (``DYNAMICEMB_CPU_ARCH``); ``DYNAMICEMB_CPU_KERNELS``
picks one by name."""

import importlib
import importlib.util
import logging
import os
from functools import lru_cache
from types import ModuleType
from typing import List

__all__ = ["COPIES", "built", "runnable", "load", "load_copy"]

_LOG = logging.getLogger("dynamicemb")

# Every copy setup.py may build, in order of preference.
COPIES = ("local", "x86_64_v4", "x86_64_v3", "baseline")
_ENV = "DYNAMICEMB_CPU_KERNELS"


def _module_name(copy: str) -> str:
    return f"dynamicemb._C_{copy}"


def built() -> List[str]:
    """The copies present in this install, in order of preference."""
    return [c for c in COPIES if importlib.util.find_spec(_module_name(c)) is not None]


def runnable() -> List[str]:
    """The built copies this CPU runs, in order of preference: ``local`` and ``baseline``
    always, a level copy where the baseline copy's ``cpu_runs`` accepts the level."""
    present = built()
    if "baseline" not in present:
        return [c for c in present if c == "local"]
    check = importlib.import_module(_module_name("baseline")).cpu_runs
    return [c for c in present
            if c in ("local", "baseline") or check(c.replace("_", "-"))]


def load_copy(copy: str) -> ModuleType:
    """The copy named ``copy``, checked to be built and runnable here.

    Raises:
        ValueError: ``copy`` is not one of ``COPIES``.
        ImportError: it is not built in this install, or this CPU cannot run it.
    """
    if copy not in COPIES:
        raise ValueError(f"{_ENV}={copy!r}: the CPU kernel copies are {', '.join(COPIES)}")
    if copy not in built():
        raise ImportError(
            f"the CPU kernel copy {copy!r} is not built in this install (built: "
            f"{', '.join(built()) or 'none'}); rebuild without DYNAMICEMB_CPU_ARCH for "
            "the dispatched copies")
    if copy not in runnable():
        raise ImportError(f"this CPU cannot run the CPU kernel copy {copy!r} "
                          f"(it runs: {', '.join(runnable())})")
    return importlib.import_module(_module_name(copy))


@lru_cache(maxsize=1)
def load() -> ModuleType:
    """The process's CPU kernels: ``DYNAMICEMB_CPU_KERNELS`` if set, else the best runnable copy.

    Raises:
        ImportError: no copy is built (the message says how to build), or the one
            asked for cannot be loaded.
    """
    wanted = os.environ.get(_ENV, "").strip()
    if wanted:
        module = load_copy(wanted)
    else:
        choices = runnable()
        if not choices:
            raise ImportError(
                "dynamicemb's CPU kernels (dynamicemb._C_*) are not built. Run `make build` "
                "(or `pip install --no-build-isolation -e .`) in the repository root.")
        module = importlib.import_module(_module_name(choices[0]))
    _LOG.debug("dynamicemb CPU kernels: %s (built for %s; this install has %s)",
               module.__name__, module.isa.replace("_", "-"), ", ".join(built()))
    return module
