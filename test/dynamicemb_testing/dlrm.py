"""The DLRM example's data layer (``examples/dlrm/data.py``) as a module.

``examples/dlrm`` is not a package, and its module names (``data``, ``model``) are
too generic to put on ``sys.path``, so the file is loaded under a name of its own,
once per process.
"""

import importlib.util
import os
import sys
from types import ModuleType

from dynamicemb_testing.scripts import ROOT

_NAME = "dynamicemb_testing._dlrm_data"


def load_dlrm_data() -> ModuleType:
    """``examples/dlrm/data.py``, loaded once (later calls return the same module)."""
    if _NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(_NAME, os.path.join(ROOT, "examples", "dlrm", "data.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[_NAME]
