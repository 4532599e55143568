"""Factories and comparisons shared by the checkpoint tests (no pytest here)."""

import io
from typing import Dict, Optional

import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs,
                        DynamicEmbOptimType, DynamicEmbScoreStrategy, DynamicEmbTableOptions,
                        FrequencyAdmissionStrategy)

OPTIMIZERS = [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM,
              DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD]
#: Row dtypes of the round trips.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_FEATURES = 3  # features 0, 1 -> table "a" (dim 8); feature 2 -> table "b" (dim 4)


def make_tables(optimizer=DynamicEmbOptimType.ADAM, caching: bool = False,
                strategy=DynamicEmbScoreStrategy.LRU, admission: bool = True,
                dims=(8, 4), capacity: int = 1024,
                dtype: Optional[torch.dtype] = None) -> BatchedDynamicEmbeddingTables:
    """Two tables ("a": 2 features, "b": 1 feature with frequency admission) of rows in
    ``dtype`` (``embedding_dtype``; None: float32); with ``caching`` a device cache of
    32 float32 rows' bytes over the host store."""
    budget = 32 * 4 * (max(dims) * 3 + 1) if caching else None
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1)
    options = [
        DynamicEmbTableOptions(dim=dims[0], max_capacity=capacity, score_strategy=strategy,
                               initializer_args=init, caching=caching,
                               local_hbm_for_values=budget, embedding_dtype=dtype),
        DynamicEmbTableOptions(dim=dims[1], max_capacity=capacity, score_strategy=strategy,
                               initializer_args=init, caching=caching,
                               local_hbm_for_values=budget, embedding_dtype=dtype,
                               admit_strategy=FrequencyAdmissionStrategy(threshold=2)
                               if admission else None),
    ]
    return BatchedDynamicEmbeddingTables(options, table_names=["a", "b"],
                                         feature_table_map=[0, 0, 1], optimizer=optimizer,
                                         learning_rate=0.05, weight_decay=0.01,
                                         weight_decay_mode="l2",
                                         initial_accumulator_value=0.1)


def batch(step: int, batch_size: int = 6, id_range: int = 300):
    """(indices, offsets) of training step ``step`` (deterministic)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 5, (NUM_FEATURES * batch_size,), generator=g)
    indices = torch.randint(0, id_range, (int(lengths.sum()),), generator=g) * 7919 - 10**6
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return indices, offsets


def train(module: BatchedDynamicEmbeddingTables, steps: range) -> torch.Tensor:
    """Trains on ``batch(s)`` for s in ``steps``; returns the outputs stacked."""
    outs = []
    for s in steps:
        out = module(*batch(s))
        ((out - 0.3) ** 2).sum().backward()
        outs.append(out.detach())
    return torch.cat(outs)


def snapshot(module: BatchedDynamicEmbeddingTables) -> Dict[str, object]:
    """Everything training depends on, rows sorted by key."""
    state: Dict[str, object] = {"train_steps": module.train_steps}
    for name in module.table_names:
        rows = module.export_keys_values(name)
        order = rows.keys.argsort()
        counters = module.export_admission_counters(name)
        corder = counters.keys.argsort()
        state[name] = {
            "rows": tuple(t[order].clone() for t in rows),
            "counters": tuple(t[corder].clone() for t in counters),
            "clocks": module.table_clocks(name),
        }
    return state


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits: floating tensors as integers of their size (so that -0.0 differs
    from 0.0 and a dtype change shows); others as they are."""
    if not t.is_floating_point():
        return t
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(a: Dict[str, object], b: Dict[str, object], skip_clocks: Optional[bool] = False) -> None:
    """Bit-for-bit equality of two snapshots (dtypes included)."""
    assert a["train_steps"] == b["train_steps"]
    for name in a:
        if name == "train_steps":
            continue
        for x, y in zip(a[name]["rows"] + a[name]["counters"], b[name]["rows"] + b[name]["counters"]):
            assert x.dtype == y.dtype and torch.equal(bits(x), bits(y)), name
        if not skip_clocks:
            assert a[name]["clocks"] == b[name]["clocks"], name


BASE_ROWS = 6000


def base_module():
    """A module big enough that a dump takes a while (about 4.6 MB of rows)."""
    module = make_tables(dims=(64, 4), capacity=1 << 16)
    g = torch.Generator().manual_seed(5)
    keys = torch.arange(BASE_ROWS, dtype=torch.int64) * 1000003 - 5 * 10**8
    module.import_keys_values("a", keys, torch.randn(BASE_ROWS, 64, generator=g),
                              torch.rand(BASE_ROWS, 128, generator=g), scores=keys % 1000)
    return module


def through_bytes(state):
    """``state`` saved by ``torch.save`` and loaded back with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)
