"""Enums shared by every layer (string values, plus upstream's integers where it has
them), the row dtypes, and upstream's ``dynamicemb.types`` names (``docs/MIGRATING.md``)."""

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
    "ROW_DTYPES",
    "ROW_DTYPE_NAMES",
    "SCORE_TYPE",
    "ScoreStrategy",
    "UpstreamIntValues",
    "check_row_dtype",
    "row_dtype_of_data_type",
]

#: dtype of stored keys (ids of int32 tables are widened to it).
KEY_TYPE = torch.int64
#: dtype of stored embedding rows.
EMBEDDING_TYPE = torch.float32
#: dtype of scores.
SCORE_TYPE = torch.int64
#: dtype of optimizer states.
OPT_STATE_TYPE = torch.float32
#: The dtypes a row's embedding can be stored in (``dynamicemb.ops.interface.RowFormat``).
ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Each of ``ROW_DTYPES`` by the name checkpoints and state dicts record it under.
ROW_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16",
                   torch.bfloat16: "bfloat16"}
#: Upstream's ``bucket_capacity`` meaning "one bucket per table" (``DynamicEmbTableOptions``).
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


def check_row_dtype(dtype, what: str = "frozen rows") -> torch.dtype:
    """``dtype`` if it is one of ``ROW_DTYPES``; else ``ValueError`` naming ``what``."""
    if dtype not in ROW_DTYPES:
        raise ValueError(f"{what} can be {[str(d) for d in ROW_DTYPES]}, got {dtype}")
    return dtype


class UpstreamIntValues:
    """Mixin: a string enum whose ``Enum(i)`` is the member upstream numbers ``i`` (names
    in upstream's order in ``_upstream_order``); other values raise ``ValueError``."""

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


# Not @unique: TIMESTAMP, upstream's name, is an alias of LRU.
class DynamicEmbScoreStrategy(UpstreamIntValues, str, Enum):
    """How a slot's score is set; a full bucket keeps the larger scores.

    - ``LRU`` (alias ``TIMESTAMP``): a logical clock advanced by every inserting call.
    - ``STEP``: the step given to ``set_step``.
    - ``LFU``: how many times the key was seen.
    - ``CUSTOMIZED``: the caller's score.
    - ``NO_EVICTION``: clock scores; a full table grows to its max, then fails inserts.
    - ``LRU_LFU``: upstream's ``(TIMESTAMP, LFU)``: the count (bits 62..32) above the
      last-access clock (bits 31..0); evicts the least frequent, then least recent.

    Upstream's integers: 0 TIMESTAMP, 1 STEP, 2 CUSTOMIZED, 3 LFU, 4 NO_EVICTION.
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
    """Upstream's eviction rule, derived from the score strategy. Upstream's (HierarchicalKV's)
    integers: 0 LRU, 1 LFU, 2 EPOCH_LRU, 3 EPOCH_LFU, 4 CUSTOMIZED."""

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
        """Upstream's rule for ``strategy``: LRU for LRU; LFU for LFU and LRU_LFU;
        CUSTOMIZED for the others."""
        strategy = DynamicEmbScoreStrategy(strategy)
        if strategy == DynamicEmbScoreStrategy.LRU:
            return cls.LRU
        if strategy in (DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.LRU_LFU):
            return cls.LFU
        return cls.CUSTOMIZED


@unique
class DynamicEmbCheckMode(UpstreamIntValues, str, Enum):
    """What a failed insert (no slot found) does (upstream's integers: 0, 1, 2 in order).

    - ``ERROR``: undo the call and raise ``RuntimeError``.
    - ``WARNING``: log a warning; the failed keys get no slot.
    - ``IGNORE``: count it only (``stats.failed_inserts``).
    """

    ERROR = "error"
    WARNING = "warning"
    IGNORE = "ignore"

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:
        return ("ERROR", "WARNING", "IGNORE")


@unique
class DynamicEmbDistType(str, Enum):
    """Which of ``W`` ranks stores a key, read as uint64, of a row-wise table.

    - ``HASH`` (default): ``splitmix64(key) % W``.
    - ``ROUNDROBIN``: ``key % W``, upstream's ``roundrobin`` (its default).
    - ``HASH_ROUNDROBIN``: ``fmix64(key) % W`` (murmur3's), upstream's ``hash_roundrobin``.
    """

    HASH = "hash"
    ROUNDROBIN = "roundrobin"
    HASH_ROUNDROBIN = "hash_roundrobin"


@unique
class DynamicEmbGradientCheck(str, Enum):
    """What a NaN or inf in a CPU step's summed row gradient does (``gradient_check`` of
    ``BatchedDynamicEmbeddingTables``; GPU steps do not check): none enters a row or its
    state, and backward raises ``ValueError``.

    - ``ROWS`` (default): a row whose sum is not finite keeps its value and state; the
      batch's other rows are updated.
    - ``BATCH``: one non-finite sum refuses the whole batch's update (one more pass
      over the summed gradients).
    """

    ROWS = "rows"
    BATCH = "batch"


#: Upstream's type of ``score_strategy``: one strategy, or a tuple of them.
ScoreStrategy = Union[DynamicEmbScoreStrategy, Tuple[DynamicEmbScoreStrategy, ...]]


def row_dtype_of_data_type(data_type, table: str) -> torch.dtype:
    """The row dtype of a TorchRec config's ``data_type`` (``DataType`` or its name):
    FP32, FP16 or BF16; else ``ValueError`` naming the table."""
    name = str(getattr(data_type, "name", data_type)).upper()
    dtypes = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"table {table!r}: data_type={name} in the table's config; dynamic "
                         f"tables store {sorted(dtypes)} rows")
    return dtypes[name]
