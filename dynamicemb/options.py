"""Table configuration: dataclasses with upstream dynamicemb's names, validated on creation."""

import abc
import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field
from enum import Enum, unique
from typing import Any, Optional, Tuple, Union

import torch

from dynamicemb.kvstore.spec import as_storage_spec
from dynamicemb.placement import load_placement
from dynamicemb.types import (MAX_BUCKET_CAPACITY, ROW_DTYPES, DynamicEmbCheckMode,
                              DynamicEmbDistType, DynamicEmbEvictStrategy, DynamicEmbScoreStrategy,
                              UpstreamIntValues)

__all__ = [
    "AdmissionStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbOptimizerArgs",
    "DynamicEmbOptimType",
    "DynamicEmbPoolingMode",
    "DynamicEmbTableOptions",
    "DynamicEmbWeightDecayMode",
    "FrequencyAdmissionStrategy",
    "KVCounter",
]


@unique
class DynamicEmbInitializerMode(str, Enum):
    """How a new row is initialized (per (seed, table, key, column), see ARCHITECTURE.md)."""

    NORMAL = "normal"
    TRUNCATED_NORMAL = "truncated_normal"
    UNIFORM = "uniform"
    CONSTANT = "constant"
    DEBUG = "debug"  # every element = key mod 100000


class DynamicEmbPoolingMode(UpstreamIntValues, str, Enum):
    """How a bag's rows are combined (upstream's and FBGEMM's integers: 0 SUM, 1 MEAN, 2 NONE)."""

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"  # sequence: one row per lookup

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:
        return ("SUM", "MEAN", "NONE")


# Not @unique: SGD (FBGEMM's, upstream's default) is an alias of EXACT_SGD.
class DynamicEmbOptimType(str, Enum):
    """Fused optimizers, named as FBGEMM's ``EmbOptimType`` (also accepted; its other
    optimizers are refused). ``SGD`` is an alias of ``EXACT_SGD``."""

    EXACT_SGD = "exact_sgd"
    SGD = "exact_sgd"
    ADAM = "adam"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"

    @classmethod
    def of(cls, value) -> "DynamicEmbOptimType":
        """This enum, its value or name (any case), or an enum with a matching name."""
        if isinstance(value, cls):
            return value
        name = getattr(value, "name", None)
        if name is None and isinstance(value, str):
            name = value.upper()
        if name is not None and name in cls.__members__:
            return cls[name]
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unsupported optimizer {value!r}; use one of {list(cls.__members__)}"
            ) from None


@unique
class DynamicEmbWeightDecayMode(UpstreamIntValues, str, Enum):
    """How ``weight_decay`` acts. FBGEMM's ``WeightDecayMode`` and its integers (0 NONE,
    1 L2, 2 DECOUPLE) are accepted; its COUNTER, COWCLIP and DECOUPLE_GLOBAL are refused.

    - ``NONE``: no weight decay (``weight_decay`` must be 0).
    - ``L2``: ``g + weight_decay * w`` before the update (torch.optim's).
    - ``DECOUPLE``: the row is scaled by ``1 - lr * weight_decay`` before the update
      (``torch.optim.AdamW``; FBGEMM's and upstream's Adam).
    """

    NONE = "none"
    L2 = "l2"
    DECOUPLE = "decouple"

    @classmethod
    def _upstream_order(cls) -> Tuple[str, ...]:
        return ("NONE", "L2", "DECOUPLE")

    @classmethod
    def of(cls, value) -> "DynamicEmbWeightDecayMode":
        """Accepts this enum, its value, FBGEMM's ``WeightDecayMode`` or its integer."""
        if isinstance(value, cls):
            return value
        name = getattr(value, "name", None)
        if name is not None and not isinstance(value, int):
            value = name.lower()
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unsupported weight_decay_mode {getattr(value, 'name', value)!r}; use one of "
                f"{[m.name for m in cls]} (FBGEMM's COUNTER, COWCLIP and DECOUPLE_GLOBAL are "
                f"not supported)") from None


@dataclass
class DynamicEmbInitializerArgs:
    """Initializer of new rows: a row is a pure function of (seed, table, key, column).

    Args:
        mean, std_dev: NORMAL and TRUNCATED_NORMAL.
        lower, upper: UNIFORM bounds (default ±sqrt(1 / max_capacity) of the table)
            and TRUNCATED_NORMAL bounds (default mean ± 2 std_dev).
        value: CONSTANT.
        seed: in [0, 2**63).
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
    """Per-table optimizer settings (HugeCTR's ``opt_params``), overriding the module's;
    upstream's ``dynamicemb.optimizer.OptimizerArgs``.

    Args:
        learning_rate, eps, beta1, beta2: hyper-parameters (each optimizer uses its own).
        weight_decay, weight_decay_mode: coefficient and ``L2`` or ``DECOUPLE``; mode
            None: ``DECOUPLE`` for ADAM (FBGEMM's rule), refused for other optimizers.
        initial_accumulator_value: initial Adagrad state.
        gradient_clipping, max_gradient: clamp the output's gradient elementwise to
            ``[-max_gradient, max_gradient]`` before the update and the per-sample
            weights' gradient (FBGEMM's CPU rule, upstream's).
    """

    optimizer: DynamicEmbOptimType = DynamicEmbOptimType.EXACT_SGD
    learning_rate: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    weight_decay_mode: Optional[DynamicEmbWeightDecayMode] = None
    gradient_clipping: bool = False
    max_gradient: float = 1.0

    def __post_init__(self) -> None:
        self.optimizer = DynamicEmbOptimType.of(self.optimizer)
        if self.weight_decay_mode is not None:
            self.weight_decay_mode = DynamicEmbWeightDecayMode.of(self.weight_decay_mode)
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
        if not isinstance(self.gradient_clipping, bool):
            raise ValueError(f"gradient_clipping must be a bool, got {self.gradient_clipping!r}")
        if self.gradient_clipping and not self.max_gradient > 0:
            raise ValueError(f"max_gradient must be > 0 with gradient_clipping, "
                             f"got {self.max_gradient}")
        self.decay_mode  # noqa: B018 (raises for a weight decay that would not apply)

    @property
    def decay_mode(self) -> DynamicEmbWeightDecayMode:
        """The weight decay in effect (``NONE`` when ``weight_decay`` is 0); ``ValueError``
        for a ``weight_decay`` > 0 that would not apply."""
        mode = self.weight_decay_mode
        if self.weight_decay == 0:
            return DynamicEmbWeightDecayMode.NONE
        if mode is None and self.optimizer == DynamicEmbOptimType.ADAM:
            return DynamicEmbWeightDecayMode.DECOUPLE
        if mode is None:
            raise ValueError(
                f"weight_decay={self.weight_decay} with {self.optimizer.name}: FBGEMM (and "
                f"upstream dynamicemb) apply no weight decay to this optimizer; pass "
                f"weight_decay_mode=L2 or DECOUPLE to apply it, or weight_decay=0")
        if mode == DynamicEmbWeightDecayMode.NONE:
            raise ValueError(f"weight_decay={self.weight_decay} has no effect with "
                             f"weight_decay_mode=NONE; use L2 or DECOUPLE, or weight_decay=0")
        return mode


class AdmissionStrategy(abc.ABC):
    """Upstream's base class of admission strategies (annotations, ``isinstance``);
    tables take only ``FrequencyAdmissionStrategy``."""


@dataclass(frozen=True)
class FrequencyAdmissionStrategy(AdmissionStrategy):
    """Admit a key into its table once it was seen ``threshold`` times; until then a
    lookup gets a transient initialized row, neither stored nor updated.

    Args:
        threshold: occurrences (within and across batches) needed; 0 and 1 admit all.
        counter_capacity: slots of the LRU counter table (unused when
            ``DynamicEmbTableOptions.admission_counter`` gives a ``KVCounter``).
        initializer_args: rows of keys not admitted yet (None: the training initializer).
    """

    threshold: int
    counter_capacity: int = 1 << 20
    initializer_args: Optional[DynamicEmbInitializerArgs] = None

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold}")
        if self.counter_capacity < 1:
            raise ValueError(f"counter_capacity must be >= 1, got {self.counter_capacity}")
        if self.initializer_args is not None and not isinstance(
                self.initializer_args, DynamicEmbInitializerArgs):
            raise ValueError("initializer_args must be a DynamicEmbInitializerArgs, got "
                             f"{type(self.initializer_args).__name__}")

    def __hash__(self) -> int:  # initializer_args is a mutable dataclass
        return hash((self.threshold, self.counter_capacity,
                     None if self.initializer_args is None
                     else dataclasses.astuple(self.initializer_args)))


@dataclass(frozen=True)
class KVCounter:
    """Upstream's admission counter table, per table and rank: ``capacity`` slots (e.g.
    ``get_sharded_table_capacity``) in buckets of ``bucket_capacity`` (a multiple of 16),
    a full bucket forgetting its lowest count; int64 keys only; checkpoints save it."""

    capacity: int
    bucket_capacity: int = 1024
    key_type: torch.dtype = torch.int64

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"KVCounter capacity must be >= 1, got {self.capacity}")
        if self.bucket_capacity <= 0 or self.bucket_capacity % 16:
            raise ValueError("KVCounter bucket_capacity must be a positive multiple of 16, "
                             f"got {self.bucket_capacity}")
        if self.key_type != torch.int64:
            raise ValueError(f"KVCounter key_type must be torch.int64, got {self.key_type}")


@dataclass
class DynamicEmbTableOptions:
    """Options of one dynamic embedding table.

    Args:
        dim: embedding dimension; None only in ``DynamicEmbParameterConstraints`` (the
            planner takes ``embedding_dim``).
        max_capacity: most rows the table holds; None only in
            ``DynamicEmbParameterConstraints`` (the planner takes ``num_embeddings``,
            the global capacity shared out among the ranks).
        init_capacity: rows allocated at first per rank (None: the rank's
            ``max_capacity``, which also caps it); the table doubles when its load
            passes ``max_load_factor``, in (0, 1].
        bucket_capacity: slots per hash bucket, a multiple of 16; or upstream's
            ``MAX_BUCKET_CAPACITY``: one bucket of ``max_capacity`` rounded up to 16
            slots, allocated at once (``in_one_bucket``); lookups scan it: small tables.
        score_strategy: a ``DynamicEmbScoreStrategy``, upstream's integer, or its
            compound ``(TIMESTAMP, LFU)`` in either order. None: LRU.
        ttl: ticks a row may go without a lookup before it expires (None: never); it
            then reads as a never-seen id, and ``expire()`` frees it in every tier.
            Ticks are steps with STEP, the table's clock (one per training batch of its
            group) with LRU, NO_EVICTION and LRU_LFU; refused with LFU and CUSTOMIZED.
        initializer_args: new rows in training.
        eval_initializer_args: rows of unseen keys in eval (default zeros).
        safe_check_mode: what a failed insert does.
        caching: a device cache of the HBM budget (required) over a host store holding
            every row; rows a batch uses are promoted.
        local_hbm_for_values: device bytes per rank for value rows (embedding +
            optimizer state). None: all rows in device memory. Without ``caching``,
            rows beyond it live in host memory only; 0: a host-only table.
        global_hbm_for_values: the same for the whole table, ``ceil(global / ranks)``
            per rank holding it; set at most one of the two.
        admit_strategy: admission of new keys (None: admit all).
        admission_counter: a ``KVCounter`` holding ``admit_strategy``'s counts.
        training: False builds an inference table: no optimizer state, never inserts.
        optimizer_args: per-table optimizer (None: the module's settings).
        dist_type: which rank stores a key of a row-wise table (``DynamicEmbDistType``
            or its value; upstream's ``continuous`` is refused).
        index_type: dtype of the ids given, int64 or int32 (keys are int64).
        embedding_dtype: dtype of stored rows' embeddings (None: float32); optimizer
            states stay float32.
        stochastic_rounding: 16-bit rows: an update writes its float32 result back
            rounded stochastically, with bits hashed from (``rounding_seed``, table,
            key, update count, column), the same on every backend, cache size and
            placement; False: to nearest.
        rounding_seed: the seed of ``stochastic_rounding``'s bits.
        evict_strategy: upstream's eviction rule: it follows ``score_strategy``, and one
            that disagrees is overwritten with a warning, as upstream does.
        external_storage: a tier below host memory (``dynamicemb.storage.external``)
            that receives the rows the host store evicts and gives them back: a
            directory (RocksDB), ``"redis://host:port"``,
            ``"redis+cluster://host:port[,...]"``, a ``RocksDBStorage``,
            ``RedisStorage`` or ``RedisClusterStorage`` spec (``run=``; ``resume=True``
            takes over an earlier module's rows, else refused), or an open ``KVStore``.
            Not with NO_EVICTION.
        local_host_for_values: with ``external_storage``, host bytes per rank for value
            rows (rounded down to a power-of-two number of buckets, at least one).
            None: ``max_capacity`` rows.
        placement: path of a placement file (``dynamicemb.placement``) for a row-wise
            table: the ids it lists for the table go to their rank there, the others to
            their ``dist_type`` owner. Made for the table's shard count (checked when
            sharded); unused with one shard.
        replicas: hot ids of a row-wise table under ``DistributedModelParallel``
            (EmbeddingCollection, or EmbeddingBagCollection on its dedup path;
            ``dynamicemb.shard.replicas``) that every rank serves from a replica instead
            of the all-to-all: an int count, or a float in (0, 1), a fraction of the
            rows stored; 0: none. Chosen from the owners' scores by
            ``dynamicemb.shard.refresh_replicas`` (a collective) or given to it.
            With ``replica_staleness`` 0, trained rows equal those without replicas
            (bit for bit with dedup).
        replica_staleness: steps a replica may lag its owner (HET-GMP's ``--bound``);
            0: synchronous. s > 0: ranks accumulate the replicas' gradients; every s
            steps the owners apply them and the copies are pulled again
            (``dynamicemb.shard.stale_replicas``). Needs
            ``replicas``, no ``admit_strategy``, and SGD, Adagrad or row-wise Adagrad
            without weight decay (checked when sharded).
        device_id: upstream's CUDA device index, accepted and unused (the module's
            ``device`` places the rows).
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
    global_hbm_for_values: Optional[int] = None
    admission_counter: Optional[KVCounter] = None
    dist_type: DynamicEmbDistType = DynamicEmbDistType.HASH
    index_type: Optional[torch.dtype] = None
    embedding_dtype: Optional[torch.dtype] = None
    stochastic_rounding: bool = True
    rounding_seed: int = 0
    evict_strategy: Optional[DynamicEmbEvictStrategy] = None
    external_storage: Any = None
    ttl: Optional[int] = None
    local_host_for_values: Optional[int] = None
    placement: Optional[str] = None
    replicas: Union[int, float] = 0
    replica_staleness: int = 0
    device_id: Optional[int] = None

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
        if self.bucket_capacity != MAX_BUCKET_CAPACITY and (
                self.bucket_capacity <= 0 or self.bucket_capacity % 16):
            raise ValueError(f"bucket_capacity must be a positive multiple of 16 or "
                             f"MAX_BUCKET_CAPACITY (one bucket per table), got "
                             f"{self.bucket_capacity}")
        if not 0.0 < self.max_load_factor <= 1.0:
            raise ValueError(f"max_load_factor must be in (0, 1], got {self.max_load_factor}")
        self.score_strategy = (DynamicEmbScoreStrategy.LRU if self.score_strategy is None
                               else score_strategy_of(self.score_strategy))
        check_ttl(self.ttl, self.score_strategy)
        self.safe_check_mode = DynamicEmbCheckMode(self.safe_check_mode)
        self._check_budgets()
        self._check_upstream_fields()
        if self.placement is not None:
            if not isinstance(self.placement, (str, os.PathLike)):
                raise ValueError(f"placement must be the path of a placement file, got a "
                                 f"{type(self.placement).__name__}")
            self.placement = os.fspath(self.placement)
            load_placement(self.placement)  # refuses a missing or corrupt file now
        self._check_replicas()

    @property
    def row_dtype(self) -> torch.dtype:
        """The stored embeddings' dtype: ``embedding_dtype``, float32 when None."""
        return torch.float32 if self.embedding_dtype is None else self.embedding_dtype

    def _check_replicas(self) -> None:
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, (int, float)):
            raise ValueError(f"replicas must be an int >= 0 (ids) or a float in (0, 1) "
                             f"(a fraction of the table's rows), got {replicas!r}")
        if isinstance(replicas, float) and not 0.0 < replicas < 1.0 and replicas != 0.0:
            raise ValueError(f"replicas as a float is a fraction of the table's rows, in (0, 1); "
                             f"got {replicas} (give a count as an int)")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        staleness = self.replica_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"replica_staleness must be an int >= 0 (steps a replica may lag "
                             f"its owner), got {staleness!r}")
        if staleness and not replicas:
            raise ValueError(f"replica_staleness={staleness} needs replicas > 0 (it bounds how "
                             f"stale the replicas are); set replicas or replica_staleness=0")
        if staleness and self.admit_strategy is not None:
            raise ValueError("replica_staleness > 0 with an admit_strategy: a replica's copy of "
                             "an id its owner has not stored is the initializer's row, which "
                             "admission may refuse to store; use replica_staleness=0")

    def _check_budgets(self) -> None:
        for name in ("local_hbm_for_values", "global_hbm_for_values"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        if self.local_hbm_for_values is not None and self.global_hbm_for_values is not None:
            raise ValueError("set one of local_hbm_for_values (per rank) and "
                             "global_hbm_for_values (split over the table's ranks), not both")
        if self.caching and self.local_hbm_for_values is None and self.global_hbm_for_values is None:
            raise ValueError("caching=True needs local_hbm_for_values or global_hbm_for_values "
                             "(the cache's bytes)")

    def _check_upstream_fields(self) -> None:
        self._check_external()
        accepted = [d.value for d in DynamicEmbDistType]
        if self.dist_type == "continuous":
            raise ValueError("dist_type='continuous' (contiguous key ranges per rank) is not "
                             f"supported: dynamic tables take any int64 key; use one of {accepted}")
        try:
            self.dist_type = DynamicEmbDistType(self.dist_type)
        except ValueError:
            raise ValueError(f"dist_type must be one of {accepted} (DynamicEmbDistType), got "
                             f"{self.dist_type!r}") from None
        if self.device_id is not None and (isinstance(self.device_id, bool) or not isinstance(
                self.device_id, int) or self.device_id < 0):
            raise ValueError(f"device_id must be None or a CUDA device index (int >= 0), got "
                             f"{self.device_id!r}")
        if self.index_type not in (None, torch.int64, torch.int32):
            raise ValueError(f"index_type must be torch.int64 or torch.int32, got {self.index_type}")
        if self.embedding_dtype is not None and self.embedding_dtype not in ROW_DTYPES:
            raise ValueError(f"embedding_dtype {self.embedding_dtype} is not supported: rows are "
                             f"stored in {[str(d) for d in ROW_DTYPES]} (output_dtype sets the "
                             "output's dtype)")
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(f"stochastic_rounding must be a bool, got "
                             f"{self.stochastic_rounding!r}")
        if isinstance(self.rounding_seed, bool) or not isinstance(self.rounding_seed, int) or \
                not 0 <= self.rounding_seed < 1 << 63:
            raise ValueError(f"rounding_seed must be an int in [0, 2**63), got "
                             f"{self.rounding_seed!r}")
        if self.admit_strategy is not None and not isinstance(self.admit_strategy,
                                                              FrequencyAdmissionStrategy):
            raise ValueError("admit_strategy must be a FrequencyAdmissionStrategy (strategy "
                             "classes of your own are not supported), got "
                             f"{type(self.admit_strategy).__name__}")
        if self.admission_counter is not None:
            if not isinstance(self.admission_counter, KVCounter):
                raise ValueError("admission_counter must be a KVCounter, got "
                                 f"{type(self.admission_counter).__name__}")
        if self.evict_strategy is not None:
            self.evict_strategy = DynamicEmbEvictStrategy(self.evict_strategy)
            derived = DynamicEmbEvictStrategy.of_score_strategy(self.score_strategy)
            if self.evict_strategy != derived:  # upstream overwrites it: so does this, loudly
                warnings.warn(
                    f"evict_strategy={self.evict_strategy.name} disagrees with score_strategy="
                    f"{self.score_strategy.name}, which evicts as {derived.name}: eviction "
                    f"follows score_strategy, as upstream's (evict_strategy is set to "
                    f"{derived.name}); for {self.evict_strategy.name} eviction set "
                    f"score_strategy={self.evict_strategy.name}", UserWarning, stacklevel=3)
                self.evict_strategy = derived

    def _check_external(self) -> None:
        if self.local_host_for_values is not None:
            if self.external_storage is None:
                raise ValueError("local_host_for_values bounds the host store in front of an "
                                 "external store: set external_storage too")
            if self.local_host_for_values <= 0:
                raise ValueError(f"local_host_for_values must be positive bytes, got "
                                 f"{self.local_host_for_values}")
        if self.external_storage is None:
            return
        self.external_storage = as_storage_spec(self.external_storage)
        if self.score_strategy == DynamicEmbScoreStrategy.NO_EVICTION:
            raise ValueError("external_storage needs a host store that evicts its rows down "
                             "to it: NO_EVICTION never evicts; use LRU")
        if self.ttl is not None:
            raise ValueError("ttl with external_storage is not supported yet: rows in the "
                             "external store would not expire; drop one of the two")

    def bucket_slots(self, rows: int) -> int:
        """Slots per bucket for ``rows`` rows: ``bucket_capacity``, or for
        ``MAX_BUCKET_CAPACITY`` ``rows`` rounded up to 16."""
        if self.bucket_capacity == MAX_BUCKET_CAPACITY:
            return -(-max(int(rows), 1) // 16) * 16
        return self.bucket_capacity

    def in_one_bucket(self) -> "DynamicEmbTableOptions":
        """With ``MAX_BUCKET_CAPACITY``, a copy whose bucket, max and init capacities are
        all ``bucket_slots(max_capacity)``; else (or without ``max_capacity``) ``self``."""
        if self.bucket_capacity != MAX_BUCKET_CAPACITY or self.max_capacity is None:
            return self
        slots = self.bucket_slots(self.max_capacity)
        return dataclasses.replace(self, bucket_capacity=slots, max_capacity=slots,
                                   init_capacity=slots)

    def device_budget(self, num_shards: int = 1) -> Optional[int]:
        """Device bytes for value rows per rank of ``num_shards`` (None: all rows on device)."""
        if self.local_hbm_for_values is not None or self.global_hbm_for_values is None:
            return self.local_hbm_for_values
        return -(-self.global_hbm_for_values // max(1, num_shards))

    def check_shape(self, table: str) -> None:
        """Raises ``ValueError`` naming ``table`` unless ``dim`` and ``max_capacity`` are set."""
        missing = [name for name in ("dim", "max_capacity") if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"table {table!r}: DynamicEmbTableOptions needs {' and '.join(missing)} "
                "(only the planner's DynamicEmbParameterConstraints may leave them unset)")


#: Upstream's compound score, as the set of its tuple's members (either order).
_COMPOUND = frozenset({DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LFU})
#: Strategies whose scores hold the time of a row's last access (what a TTL reads).
TTL_STRATEGIES = (DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.STEP,
                  DynamicEmbScoreStrategy.NO_EVICTION, DynamicEmbScoreStrategy.LRU_LFU)


def score_strategy_of(value) -> DynamicEmbScoreStrategy:
    """A score strategy from a member, value, upstream integer or tuple: ``(X,)`` is
    ``X``, ``(TIMESTAMP, LFU)`` in either order ``LRU_LFU``; other tuples are refused."""
    if isinstance(value, (tuple, list)):
        members = [DynamicEmbScoreStrategy(v) for v in value]
        if len(members) == 1:
            return members[0]
        if len(members) == 2 and frozenset(members) == _COMPOUND:
            return DynamicEmbScoreStrategy.LRU_LFU
        raise ValueError(f"compound score_strategy {tuple(value)} is not supported; the one "
                         "compound is (TIMESTAMP, LFU) (LRU_LFU), or use one strategy")
    return DynamicEmbScoreStrategy(value)


def check_ttl(ttl, strategy: DynamicEmbScoreStrategy) -> None:
    """Raises ``ValueError`` unless ``ttl`` is None or a positive int ``strategy`` can measure."""
    if ttl is None:
        return
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0:
        raise ValueError(f"ttl must be a positive int (ticks of the table's time), got {ttl!r}")
    if strategy not in TTL_STRATEGIES:
        raise ValueError(
            f"ttl={ttl} needs a score that records the last access; score_strategy="
            f"{strategy.name} does not (use one of {[s.name for s in TTL_STRATEGIES]})")
