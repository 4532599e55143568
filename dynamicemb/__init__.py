"""dynamicemb: TorchRec-compatible dynamic embedding tables on a scored hash table."""

from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__version__ = "0.1.0"

__all__ = [
    "DynamicEmbCheckMode",
    "DynamicEmbScoreStrategy",
    "ScoredHashTable",
]
