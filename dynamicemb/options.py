"""Configuration of dynamic embedding tables: dataclasses validated on creation.

Names follow upstream NVIDIA dynamicemb so its users feel at home; every option
does what it says, and options that need a part not built yet are refused with
an error rather than accepted and ignored.
"""

import math
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Optional

from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = [
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbOptimizerArgs",
    "DynamicEmbOptimType",
    "DynamicEmbPoolingMode",
    "DynamicEmbTableOptions",
    "FrequencyAdmissionStrategy",
]


@unique
class DynamicEmbInitializerMode(str, Enum):
    """How a new row is initialized (per (seed, table, key, column), see ARCHITECTURE.md)."""

    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"
    DEBUG = "debug"  # every element = key mod 100000


@unique
class DynamicEmbPoolingMode(str, Enum):
    SUM = "sum"
    MEAN = "mean"
    NONE = "none"  # sequence: one row per lookup


@unique
class DynamicEmbOptimType(str, Enum):
    """Fused optimizers; names as FBGEMM's ``EmbOptimType`` (which is also accepted)."""

    EXACT_SGD = "exact_sgd"
    ADAM = "adam"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"

    @classmethod
    def of(cls, value) -> "DynamicEmbOptimType":
        """Accepts this enum, its value, or any enum with a matching name (FBGEMM's)."""
        if isinstance(value, cls):
            return value
        name = getattr(value, "name", None)
        if name is not None and name in cls.__members__:
            return cls[name]
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unsupported optimizer {value!r}; use one of {[m.name for m in cls]}"
            ) from None


@dataclass
class DynamicEmbInitializerArgs:
    """Initializer of new rows.

    Args:
        mode: the distribution.
        mean, std_dev: NORMAL and TRUNCATED_NORMAL.
        lower, upper: UNIFORM bounds (default ±sqrt(1 / max_capacity) of the table)
            and TRUNCATED_NORMAL bounds (default mean ± 2 std_dev).
        value: CONSTANT.
        seed: rows are a pure function of (seed, table, key, column).
    """

    mode: DynamicEmbInitializerMode = DynamicEmbInitializerMode.UNIFORM
    mean: float = 0.0
    std_dev: float = 1.0
    lower: Optional[float] = None
    upper: Optional[float] = None
    value: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.mode = DynamicEmbInitializerMode(self.mode)
        if self.std_dev < 0:
            raise ValueError(f"std_dev must be >= 0, got {self.std_dev}")
        if self.lower is not None and self.upper is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must not exceed upper ({self.upper})")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    def bounds(self, max_capacity: int) -> tuple:
        """(lower, upper) with the mode's defaults filled in."""
        if self.mode == DynamicEmbInitializerMode.TRUNCATED_NORMAL:
            low = self.mean - 2 * self.std_dev if self.lower is None else self.lower
            high = self.mean + 2 * self.std_dev if self.upper is None else self.upper
            return low, high
        bound = math.sqrt(1.0 / max_capacity)
        return (-bound if self.lower is None else self.lower,
                bound if self.upper is None else self.upper)


def _zeros() -> DynamicEmbInitializerArgs:
    return DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.0)


@dataclass
class DynamicEmbOptimizerArgs:
    """Per-table optimizer settings (HugeCTR's ``opt_params``); overrides the module's.

    Args:
        optimizer: the update rule.
        learning_rate, eps, beta1, beta2, weight_decay: its hyper-parameters
            (weight decay is L2: ``g + weight_decay * w``).
        initial_accumulator_value: initial Adagrad state.
    """

    optimizer: DynamicEmbOptimType = DynamicEmbOptimType.EXACT_SGD
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        self.optimizer = DynamicEmbOptimType.of(self.optimizer)
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.initial_accumulator_value < 0:
            raise ValueError("initial_accumulator_value must be >= 0")


@dataclass(frozen=True)
class FrequencyAdmissionStrategy:
    """Admit a key into its table once it was seen ``threshold`` times.

    Until then a lookup of the key gets a transient initialized row that is not
    stored and not updated. Occurrences are counted in a counter table of
    ``counter_capacity`` slots (LRU: long-unseen counts are forgotten).

    Args:
        threshold: occurrences (within and across batches) needed; 1 admits all.
        counter_capacity: slots of the counter table.
    """

    threshold: int
    counter_capacity: int = 1 << 20

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {self.threshold}")
        if self.counter_capacity < 1:
            raise ValueError(f"counter_capacity must be >= 1, got {self.counter_capacity}")


@dataclass
class DynamicEmbTableOptions:
    """Options of one dynamic embedding table.

    Args:
        dim: embedding dimension. May be left ``None`` only in
            ``DynamicEmbParameterConstraints``: the planner fills it from the table's
            ``embedding_dim``.
        max_capacity: most rows the table holds. May be left ``None`` only in
            ``DynamicEmbParameterConstraints``: the planner fills it from the table's
            ``num_embeddings`` (the global capacity, shared out among the ranks).
        init_capacity: rows allocated at first (default ``max_capacity``); the
            table doubles when its load passes ``max_load_factor``.
        bucket_capacity: slots per hash bucket (multiple of 16).
        max_load_factor: growth threshold in (0, 1].
        score_strategy: eviction scores (LRU/TIMESTAMP, STEP, LFU, CUSTOMIZED,
            NO_EVICTION).
        initializer_args: new rows in training.
        eval_initializer_args: rows of unseen keys in eval (zeros by default).
        safe_check_mode: what a failed insert does.
        caching: keep hot rows in a device cache of ``local_hbm_for_values`` bytes
            over a host store holding every row (rows a batch uses are promoted).
        local_hbm_for_values: device bytes for value rows (embedding + optimizer
            state). None: every row in device memory. With ``caching=False`` and a
            budget smaller than the table, rows beyond it live in host memory only
            (no promotion); 0: a host-only table.
        admit_strategy: admission of new keys (None: admit all).
        training: False builds an inference table: no optimizer state, never inserts.
        optimizer_args: per-table optimizer (None: the module's settings).
    """

    dim: Optional[int] = None
    max_capacity: Optional[int] = None
    init_capacity: Optional[int] = None
    bucket_capacity: int = 128
    max_load_factor: float = 0.5
    score_strategy: DynamicEmbScoreStrategy = DynamicEmbScoreStrategy.LRU
    initializer_args: DynamicEmbInitializerArgs = field(default_factory=DynamicEmbInitializerArgs)
    eval_initializer_args: DynamicEmbInitializerArgs = field(default_factory=_zeros)
    safe_check_mode: DynamicEmbCheckMode = DynamicEmbCheckMode.IGNORE
    caching: bool = False
    local_hbm_for_values: Optional[int] = None
    admit_strategy: Optional[FrequencyAdmissionStrategy] = None
    training: bool = True
    optimizer_args: Optional[DynamicEmbOptimizerArgs] = None

    def __post_init__(self) -> None:
        if self.dim is not None and self.dim <= 0:
            raise ValueError(f"dim must be positive, got {self.dim}")
        if self.max_capacity is not None and self.max_capacity <= 0:
            raise ValueError(f"max_capacity must be positive, got {self.max_capacity}")
        if self.init_capacity is not None and not 0 < self.init_capacity <= (
                self.max_capacity if self.max_capacity is not None else self.init_capacity):
            raise ValueError(
                f"init_capacity must be in (0, max_capacity={self.max_capacity}], "
                f"got {self.init_capacity}"
            )
        if self.bucket_capacity <= 0 or self.bucket_capacity % 16:
            raise ValueError(
                f"bucket_capacity must be a positive multiple of 16, got {self.bucket_capacity}"
            )
        if not 0.0 < self.max_load_factor <= 1.0:
            raise ValueError(f"max_load_factor must be in (0, 1], got {self.max_load_factor}")
        self.score_strategy = DynamicEmbScoreStrategy(self.score_strategy)
        self.safe_check_mode = DynamicEmbCheckMode(self.safe_check_mode)
        if self.local_hbm_for_values is not None and self.local_hbm_for_values < 0:
            raise ValueError(
                f"local_hbm_for_values must be >= 0 bytes, got {self.local_hbm_for_values}")
        if self.caching and self.local_hbm_for_values is None:
            raise ValueError("caching=True needs local_hbm_for_values (the cache's bytes)")

    def check_shape(self, table: str) -> None:
        """Raises ``ValueError`` unless ``dim`` and ``max_capacity`` are set (a table
        built outside the planner has no config to take them from).

        Args:
            table: the table's name, for the message.
        """
        missing = [name for name in ("dim", "max_capacity") if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"table {table!r}: DynamicEmbTableOptions needs {' and '.join(missing)} "
                "(only the planner's DynamicEmbParameterConstraints may leave them unset)")
