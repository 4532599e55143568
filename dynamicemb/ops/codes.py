"""The codes the kernels share with Python, mirroring the headers of ``csrc/dynamicemb``."""

from enum import IntEnum
from typing import Tuple

from dynamicemb.options import DynamicEmbInitializerMode, DynamicEmbOptimType
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = [
    "ALL_BITS",
    "COMPOUND_COUNT_SHIFT",
    "COMPOUND_TIME_MASK",
    "HOST_ROW_BIT",
    "TRANSIENT_ROW_BIT",
    "InsertStatus",
    "KNO_BUCKET",
    "ScoreRule",
    "init_mode_code",
    "metadata_bytes_per_slot",
    "num_buckets_for",
    "offsets_problem",
    "optimizer_code",
    "optimizer_state_dim",
    "score_rule",
]


class InsertStatus(IntEnum):
    """What an inserting verb did with one key (``InsertStatus``, hash_primitives.h)."""

    HIT = 0
    INSERTED = 1
    EVICTED_AND_INSERTED = 2
    FAILED = 3


class ScoreRule(IntEnum):
    """How an inserting verb scores the keys it touches (``ScoreRule``, hash_primitives.h)."""

    CLOCK = 0  # the call's clock or step
    COUNT = 1  # old score + the key's count (LFU)
    GIVEN = 2  # the caller's score
    COUNT_THEN_CLOCK = 3  # LRU_LFU: count (bits 62..32) + key's count, stamped with the clock


#: LRU_LFU scores keep the last access in their low 32 bits (``CountThenClockScore``,
#: hash_primitives.h), the count above it; clock and step scores are the time itself.
COMPOUND_COUNT_SHIFT = 32
COMPOUND_TIME_MASK = (1 << COMPOUND_COUNT_SHIFT) - 1
ALL_BITS = -1  # the time mask of clock and step scores: the whole score


#: Row references (``csrc/dynamicemb/row_ref.h``): >= HOST_ROW_BIT name host-store
#: slots, from TRANSIENT_ROW_BIT below it a batch's transient rows, below that
#: device-tier slots; a negative reference is a row its table's initializer computes.
HOST_ROW_BIT = 1 << 62
TRANSIENT_ROW_BIT = 1 << 61

_RULES = {
    DynamicEmbScoreStrategy.LRU: (ScoreRule.CLOCK, True),
    DynamicEmbScoreStrategy.STEP: (ScoreRule.CLOCK, True),
    DynamicEmbScoreStrategy.LFU: (ScoreRule.COUNT, True),
    DynamicEmbScoreStrategy.CUSTOMIZED: (ScoreRule.GIVEN, True),
    DynamicEmbScoreStrategy.NO_EVICTION: (ScoreRule.CLOCK, False),
    DynamicEmbScoreStrategy.LRU_LFU: (ScoreRule.COUNT_THEN_CLOCK, True),
}


def score_rule(strategy: DynamicEmbScoreStrategy) -> Tuple[ScoreRule, bool]:
    """(score rule, whether a full bucket evicts) of a score strategy."""
    return _RULES[DynamicEmbScoreStrategy(strategy)]


_OPTIMIZER_CODES = {  # OptimizerKind, optimizer_primitives.h
    DynamicEmbOptimType.EXACT_SGD: 0,
    DynamicEmbOptimType.ADAM: 1,
    DynamicEmbOptimType.EXACT_ADAGRAD: 2,
    DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 3,
}

_INIT_MODE_CODES = {  # InitMode, init_primitives.h
    DynamicEmbInitializerMode.NORMAL: 0,
    DynamicEmbInitializerMode.TRUNCATED_NORMAL: 1,
    DynamicEmbInitializerMode.UNIFORM: 2,
    DynamicEmbInitializerMode.CONSTANT: 3,
    DynamicEmbInitializerMode.DEBUG: 4,
}


def optimizer_code(optimizer: DynamicEmbOptimType) -> int:
    """The kernels' code of an optimizer."""
    return _OPTIMIZER_CODES[optimizer]


def init_mode_code(mode: DynamicEmbInitializerMode) -> int:
    """The kernels' code of an initializer mode."""
    return _INIT_MODE_CODES[mode]


def offsets_problem(word: int) -> int:
    """The ``check_offsets`` problem code held by an error word (0: none; the kernel keeps
    max(4 - code), so the smallest code wins)."""
    return 4 - int(word) if word else 0


def optimizer_state_dim(optimizer: DynamicEmbOptimType, dim: int) -> int:
    """Floats of optimizer state stored after the embedding in each value row."""
    return {
        DynamicEmbOptimType.EXACT_SGD: 0,
        DynamicEmbOptimType.ADAM: 2 * dim,
        DynamicEmbOptimType.EXACT_ADAGRAD: dim,
        DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 1,
    }[optimizer]


def num_buckets_for(capacity: int, bucket_capacity: int) -> int:
    """Buckets for ``capacity`` slots: the smallest power of two that holds them."""
    buckets = max(1, -(-capacity // bucket_capacity))
    return 1 << (buckets - 1).bit_length()


def metadata_bytes_per_slot(bucket_capacity: int) -> float:
    """Bytes of a slot besides its value row: key 8, score 8, table id 2, digest 1, and
    its occupied and pinned bits (a 64-bit word each per 64 slots of a bucket)."""
    words = (bucket_capacity + 63) // 64
    return 8 + 8 + 2 + 1 + 2 * 8 * words / bucket_capacity


#: The bucket of a key an inserting pass skips (``kNoBucket``, hash_primitives.h).
KNO_BUCKET = 0x7FFFFFFF
