"""Enums shared by every layer, defined once (string values)."""

from enum import Enum, unique

__all__ = ["DynamicEmbCheckMode", "DynamicEmbScoreStrategy"]


# Not @unique on purpose: TIMESTAMP is an alias of LRU, kept for users of
# upstream dynamicemb, where the LRU score is a timestamp.
class DynamicEmbScoreStrategy(str, Enum):
    """How a slot's score is set; larger scores are kept when a bucket is full.

    - ``LRU`` (alias ``TIMESTAMP``): a logical clock advanced by every inserting call.
    - ``STEP``: the step given to ``set_step`` (e.g. the training iteration).
    - ``LFU``: how many times the key was seen.
    - ``CUSTOMIZED``: the caller's score.
    - ``NO_EVICTION``: clock scores, but a full table grows up to its maximum
      capacity and then reports failed inserts instead of evicting.
    """

    LRU = "lru"
    TIMESTAMP = "lru"
    STEP = "step"
    LFU = "lfu"
    CUSTOMIZED = "customized"
    NO_EVICTION = "no_eviction"


@unique
class DynamicEmbCheckMode(str, Enum):
    """What a failed insert (no slot could be found) does.

    - ``ERROR``: undo the call and raise ``RuntimeError``.
    - ``WARNING``: log a warning; the failed keys get no slot.
    - ``IGNORE``: count it only (``stats.failed_inserts``).
    """

    ERROR = "error"
    WARNING = "warning"
    IGNORE = "ignore"
