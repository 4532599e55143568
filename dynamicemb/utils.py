"""Upstream dynamicemb's module path ``dynamicemb.utils``: ``TORCHREC_TYPES`` and
``DTYPE_NUM_BYTES`` (imports TorchRec).

The code lives in ``dynamicemb.compat.utils``, with the ``__getattr__`` that refuses
upstream's names not provided here; this module only re-exports it
(``docs/MIGRATING.md``).
"""

from dynamicemb.compat.utils import (  # noqa: F401
    DTYPE_NUM_BYTES,
    TORCHREC_TYPES,
    __getattr__,
)

__all__ = [
    "DTYPE_NUM_BYTES",
    "TORCHREC_TYPES",
]
