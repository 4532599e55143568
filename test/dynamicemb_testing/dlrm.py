"""The DLRM example's data layer (``examples/dlrm/data.py``) as a module, and the job
under torchrun.

``examples/dlrm`` is not a package, and its module names (``data``, ``model``) are
too generic to put on ``sys.path``, so the file is loaded under a name of its own,
once per process.
"""

import importlib.util
import os
import subprocess
import sys
from types import ModuleType
from typing import Dict, Optional

from dynamicemb_testing.scripts import ROOT, run_python

_NAME = "dynamicemb_testing._dlrm_data"
# python arguments of the job on 2 ranks, and its environment (added to script_env())
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.join(ROOT, "examples", "dlrm", "train.py")]
JOB_ENV = dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def load_dlrm_data() -> ModuleType:
    """``examples/dlrm/data.py``, loaded once (later calls return the same module)."""
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, os.path.join(ROOT, "examples", "dlrm", "data.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]


def torchrun(*args, timeout: float = 600, env: Optional[Dict[str, str]] = None
             ) -> subprocess.CompletedProcess:
    """``examples/dlrm/train.py *args`` on 2 gloo ranks under torchrun (standalone,
    loopback), output captured, ``env`` added to ``JOB_ENV``; see ``run_python``."""
    return run_python(TORCHRUN + [*args], timeout=timeout, env=dict(JOB_ENV, **(env or {})))
