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
from typing import Dict, Optional

from dynamicemb_testing.scripts import ROOT, run_python

# python arguments of the job on 2 ranks, and its environment (added to script_env())
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.join(ROOT, "examples", "dlrm", "train.py")]
JOB_ENV = dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _load_example_module(stem: str) -> ModuleType:
    """``examples/dlrm/<stem>.py`` (one that imports none of its siblings), loaded once
    under a name of its own (later calls return the same module)."""
    name = f"dynamicemb_testing._dlrm_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "dlrm", f"{stem}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_dlrm_data() -> ModuleType:
    """``examples/dlrm/data.py``, loaded once (later calls return the same module)."""
    return _load_example_module("data")


def load_dlrm_checkpoint() -> ModuleType:
    """``examples/dlrm/checkpoint.py`` (the job's save and resume), loaded once."""
    return _load_example_module("checkpoint")


def torchrun(*args, timeout: float = 600, env: Optional[Dict[str, str]] = None
             ) -> subprocess.CompletedProcess:
    """``examples/dlrm/train.py *args`` on 2 gloo ranks under torchrun (standalone,
    loopback), output captured, ``env`` added to ``JOB_ENV``; see ``run_python``."""
    return run_python(TORCHRUN + [*args], timeout=timeout, env=dict(JOB_ENV, **(env or {})))
