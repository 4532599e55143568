"""Enums shared by every layer, defined once (string values), and upstream
dynamicemb's ``dynamicemb.types`` names.

Every enum that upstream NVIDIA dynamicemb defines with integer values also takes
those integers (``DynamicEmbScoreStrategy(1)`` is ``STEP``), so scripts written
for upstream run unchanged; unknown values are refused with the accepted ones.

Upstream's other names in this module: its dtypes of stored data (``KEY_TYPE``,
``EMBEDDING_TYPE``, ``SCORE_TYPE``, ``OPT_STATE_TYPE``) and ``MAX_BUCKET_CAPACITY``
are defined here; ``DynamicEmbInitializerArgs``, ``DynamicEmbInitializerMode``,
``Counter``, ``AdmissionStrategy``, ``BUCKET_ALIGNMENT`` and ``DEMB_TABLE_ALIGN_SIZE``
are this package's objects of those names, imported on first use; ``ScoreStrategy`` is
upstream's type of ``score_strategy``; the storage and cache interfaces,
``MemoryType``, ``COUNTER_TYPE`` and ``torch_dtype_to_np_dtype`` are refused by name
with what to use instead.
"""

from enum import Enum, unique
from typing import Tuple, Union

import torch

from dynamicemb._upstream import module_getattr

__all__ = [
    "DynamicEmbCheckMode",
    "DynamicEmbDistType",
    "DynamicEmbEvictStrategy",
    "DynamicEmbScoreStrategy",
    "EMBEDDING_TYPE",
    "KEY_TYPE",
    "MAX_BUCKET_CAPACITY",
    "OPT_STATE_TYPE",
    "SCORE_TYPE",
    "ScoreStrategy",
    "UpstreamIntValues",
]

#: dtype of stored keys (ids of int32 tables are widened to it).
KEY_TYPE = torch.int64
#: dtype of stored embedding rows.
EMBEDDING_TYPE = torch.float32
#: dtype of scores.
SCORE_TYPE = torch.int64
#: dtype of optimizer states.
OPT_STATE_TYPE = torch.float32
#: Upstream's ``bucket_capacity`` meaning "one bucket per table": refused by
#: ``DynamicEmbTableOptions`` (buckets here hold a multiple of 16 slots).
MAX_BUCKET_CAPACITY = 2**63 - 1

__getattr__ = module_getattr(
    __name__,
    lazy={
        "DynamicEmbInitializerArgs": "dynamicemb.options:DynamicEmbInitializerArgs",
        "DynamicEmbInitializerMode": "dynamicemb.options:DynamicEmbInitializerMode",
        "Counter": "dynamicemb.embedding.admission:Counter",
        "AdmissionStrategy": "dynamicemb.options:AdmissionStrategy",
        "BUCKET_ALIGNMENT": "dynamicemb.sizing:BUCKET_ALIGNMENT",
        "DEMB_TABLE_ALIGN_SIZE": "dynamicemb.sizing:DEMB_TABLE_ALIGN_SIZE",
    },
    refused=("MemoryType", "COUNTER_TYPE", "torch_dtype_to_np_dtype",
             "Storage", "Cache", "CopyMode", "OptionsT", "OptimizerT"),
)


class UpstreamIntValues:
    """Mixin for a string-valued enum whose upstream twin has integer values.

    The enum lists its member names in upstream's integer order in
    ``_upstream_order``; ``Enum(i)`` then returns the member upstream numbers ``i``.
    Any other value is refused with a ``ValueError`` naming the accepted ones.
    """

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:  # pragma: no cover - each enum overrides
        return ()

    @classmethod
    def _missing_(cls, value):
        order = cls._upstream_order()
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(order):
            return cls[order[value]]
        accepted = [m.value for m in cls] + list(range(len(order)))
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; use a member, its value "
                         f"or upstream's integer: {accepted}")


# Not @unique on purpose: TIMESTAMP is an alias of LRU, kept for users of
# upstream dynamicemb, where the LRU score is a timestamp.
class DynamicEmbScoreStrategy(UpstreamIntValues, str, Enum):
    """How a slot's score is set; larger scores are kept when a bucket is full.

    - ``LRU`` (alias ``TIMESTAMP``): a logical clock advanced by every inserting call.
    - ``STEP``: the step given to ``set_step`` (e.g. the training iteration).
    - ``LFU``: how many times the key was seen.
    - ``CUSTOMIZED``: the caller's score.
    - ``NO_EVICTION``: clock scores, but a full table grows up to its maximum
      capacity and then reports failed inserts instead of evicting.
    - ``LRU_LFU``: upstream's compound ``(TIMESTAMP, LFU)``: one word holding how many
      times the key was seen (bits 62..32) above the clock of its last access (bits
      31..0), so eviction takes the least frequent key, the least recent among equals.

    Upstream's integers: 0 TIMESTAMP, 1 STEP, 2 CUSTOMIZED, 3 LFU, 4 NO_EVICTION
    (the compound has none: upstream spells it as the tuple).
    """

    LRU = "lru"
    TIMESTAMP = "lru"
    STEP = "step"
    LFU = "lfu"
    CUSTOMIZED = "customized"
    NO_EVICTION = "no_eviction"
    LRU_LFU = "lru_lfu"

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:
        return ("TIMESTAMP", "STEP", "CUSTOMIZED", "LFU", "NO_EVICTION")


@unique
class DynamicEmbEvictStrategy(UpstreamIntValues, str, Enum):
    """Upstream's name for the eviction rule, which it derives from the score strategy
    (a ``DynamicEmbTableOptions.evict_strategy`` that disagrees with ``score_strategy``
    is overwritten with a warning, as upstream overwrites it).

    Upstream's integers (HierarchicalKV's): 0 LRU, 1 LFU, 2 EPOCH_LRU, 3 EPOCH_LFU,
    4 CUSTOMIZED.
    """

    LRU = "lru"
    LFU = "lfu"
    EPOCH_LRU = "epoch_lru"
    EPOCH_LFU = "epoch_lfu"
    CUSTOMIZED = "customized"

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:
        return ("LRU", "LFU", "EPOCH_LRU", "EPOCH_LFU", "CUSTOMIZED")

    @classmethod
    def of_score_strategy(cls, strategy: DynamicEmbScoreStrategy) -> "DynamicEmbEvictStrategy":
        """The eviction rule upstream derives from a score strategy (TIMESTAMP: LRU,
        LFU and LRU_LFU (frequency first): LFU, STEP / CUSTOMIZED / NO_EVICTION:
        CUSTOMIZED)."""
        strategy = DynamicEmbScoreStrategy(strategy)
        if strategy == DynamicEmbScoreStrategy.LRU:
            return cls.LRU
        if strategy in (DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.LRU_LFU):
            return cls.LFU
        return cls.CUSTOMIZED


@unique
class DynamicEmbCheckMode(UpstreamIntValues, str, Enum):
    """What a failed insert (no slot could be found) does.

    - ``ERROR``: undo the call and raise ``RuntimeError``.
    - ``WARNING``: log a warning; the failed keys get no slot.
    - ``IGNORE``: count it only (``stats.failed_inserts``).

    Upstream's integers: 0 ERROR, 1 WARNING, 2 IGNORE.
    """

    ERROR = "error"
    WARNING = "warning"
    IGNORE = "ignore"

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:
        return ("ERROR", "WARNING", "IGNORE")


@unique
class DynamicEmbDistType(str, Enum):
    """Which rank stores a key of a row-wise dynamic table (``dist_type``), of ``W``
    ranks; every function reads the int64 key as an unsigned 64-bit word
    (``dynamicemb.placement``).

    - ``HASH`` (the default): ``splitmix64(key) % W``, splitmix64's finalizer.
    - ``ROUNDROBIN``: ``key % W``, upstream's ``roundrobin`` (its default). A
      negative key counts as ``key + 2**64``, as upstream's uint64 cast reads it.
    - ``HASH_ROUNDROBIN``: ``fmix64(key) % W``, murmur3's finalizer, upstream's
      ``hash_roundrobin``.

    Upstream's ``continuous`` (key ranges) is refused by ``DynamicEmbTableOptions``.
    """

    HASH = "hash"
    ROUNDROBIN = "roundrobin"
    HASH_ROUNDROBIN = "hash_roundrobin"


@unique
class DynamicEmbGradientCheck(str, Enum):
    """What a NaN or inf in the gradient of a training step does, on the CPU
    (``gradient_check`` of ``BatchedDynamicEmbeddingTables``). What is checked is each
    unique row's summed gradient: a non-finite gradient value (or per-sample weight)
    reaches the sum of every row that reads it. Either way no NaN/inf enters a row or
    its optimizer state, and the backward raises ``ValueError``.

    - ``ROWS`` (the default): the backward sums and updates each row in one pass; a
      row whose sum is not finite keeps its value and state, every other row of the
      batch is updated, then the error is raised.
    - ``BATCH``: every row's sum is written and checked before any row changes; one
      non-finite sum refuses the whole batch's update (no row or state changes). It
      moves the summed gradients through memory once more: about 0.5 ms of a 6 ms
      step at batch 65,536, dim 128 (benchmark/RESULTS.md, "The CPU backward's
      gradient check").

    A GPU step does not check gradient values (each check would wait for the device).
    """

    ROWS = "rows"
    BATCH = "batch"


#: Upstream's type of ``score_strategy``: one strategy, or a tuple of them (the
#: compound ``(TIMESTAMP, LFU)`` in either order; ``DynamicEmbTableOptions`` refuses
#: other tuples).
ScoreStrategy = Union[DynamicEmbScoreStrategy, Tuple[DynamicEmbScoreStrategy, ...]]
