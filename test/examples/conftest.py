"""Makes the DLRM example's data layer importable as ``dlrm_data``.

``examples/dlrm`` is not a package on the path, and its module names (``data``,
``model``) are too generic to put on ``sys.path``, so the file is loaded under a
name of its own.
"""

import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "dlrm", "data.py")

if "dlrm_data" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("dlrm_data", os.path.normpath(_PATH))
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["dlrm_data"] = _module
    _spec.loader.exec_module(_module)
