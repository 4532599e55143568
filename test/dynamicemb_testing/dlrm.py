"""The DLRM example's data layer (``examples/dlrm/data.py``) and checkpoint module as
modules, and the job under torchrun.

``examples/dlrm`` is not a package, and its module names (``data``, ``model``) are
too generic to put on ``sys.path``, so each file is loaded under a name of its own,
once per process.
"""

import importlib.util
import os
import subprocess
import sys
from types import ModuleType
from typing import Dict, Optional, Sequence

from dynamicemb_testing.scripts import ROOT, run_python

# python arguments of the job on 2 ranks, and its environment (added to script_env())
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.join(ROOT, "examples", "dlrm", "train.py")]
JOB_ENV = dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _load_example_module(stem: str, siblings: Sequence[str] = ()) -> ModuleType:
    """``examples/dlrm/<stem>.py``, loaded once under a name of its own (later calls
    return the same module). The ``siblings`` it imports (``from data import ...``)
    are loaded the same way and seen under their plain names only while it loads."""
    name = f"dynamicemb_testing._dlrm_{stem}"
    if name not in sys.modules:
        loaded = {sibling: _load_example_module(sibling) for sibling in siblings}
        saved = {sibling: sys.modules.get(sibling) for sibling in siblings}
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "dlrm", f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.modules.update(loaded)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            for sibling, previous in saved.items():
                if previous is None:
                    del sys.modules[sibling]
                else:
                    sys.modules[sibling] = previous
    return sys.modules[name]


def load_dlrm_data() -> ModuleType:
    """``examples/dlrm/data.py``, loaded once (later calls return the same module)."""
    return _load_example_module("data")


def load_dlrm_movielens() -> ModuleType:
    """``examples/dlrm/movielens.py`` (MovieLens-100K), its ``data`` being
    :func:`load_dlrm_data`'s, loaded once."""
    return _load_example_module("movielens", siblings=("data",))


def load_dlrm_checkpoint() -> ModuleType:
    """``examples/dlrm/checkpoint.py`` (the job's save and resume), loaded once."""
    return _load_example_module("checkpoint")


def torchrun(*args, timeout: float = 600, env: Optional[Dict[str, str]] = None
             ) -> subprocess.CompletedProcess:
    """``examples/dlrm/train.py *args`` on 2 gloo ranks under torchrun (standalone,
    loopback), output captured, ``env`` added to ``JOB_ENV``; see ``run_python``."""
    return run_python(TORCHRUN + [*args], timeout=timeout, env=dict(JOB_ENV, **(env or {})))
