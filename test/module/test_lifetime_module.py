"""Row lifetime in ``BatchedDynamicEmbeddingTables``: TTL on every tier layout, against
a dict model of the rows; admission of expired keys; checkpoints across an expiry.

The model: SGD on sequence lookups with an all-ones output gradient, so a stored row is
its initial row minus ``lr`` times the lookups since it was born, and a row expired at a
lookup is born again (its initial row comes from a twin module that never trained:
initializers are functions of (seed, table, key)).
"""

import random

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbDump,
                        DynamicEmbInitializerArgs, DynamicEmbLoad, DynamicEmbScoreStrategy,
                        DynamicEmbTableOptions, FrequencyAdmissionStrategy)
from dynamicemb import expire as expire_model

S = DynamicEmbScoreStrategy
DIM, LR, TTL = 4, 0.25, 3
NAMES = ["a", "b"]
#: (caching, device rows): one tier, a cache, a placement tier, host only.
LAYOUTS = {"one-tier": (False, None), "cache": (True, 16), "placed": (False, 16),
           "host-only": (False, 0)}


def make_module(strategy, layout="one-tier", ttl=TTL, admit=None) -> BatchedDynamicEmbeddingTables:
    caching, rows = LAYOUTS[layout]
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=256, bucket_capacity=16, score_strategy=strategy, ttl=ttl,
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=5),
        caching=caching, local_hbm_for_values=None if rows is None else rows * DIM * 4,
        admit_strategy=admit)
    return BatchedDynamicEmbeddingTables([options, options], table_names=NAMES,
                                         pooling_mode="none", optimizer="exact_sgd",
                                         learning_rate=LR)


def batch(rng: random.Random, keys_per_table: int = 12):
    """Two features (one per table), 4 bags each, 0-3 ids per bag from a small pool."""
    lengths = [rng.randrange(4) for _ in range(8)]
    ids = [rng.randrange(keys_per_table) for _ in range(sum(lengths))]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    tables = [0 if bag < 4 else 1 for bag, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor(ids), torch.tensor(offsets), tables


class RowModel:
    """{(table, key): [last step, row]}: what survives and what each row holds."""

    def __init__(self, strategy, keys_per_table: int = 12):
        fresh = make_module(strategy, ttl=None)  # never trained: initial rows
        keys = torch.arange(keys_per_table).repeat(2)
        offsets = torch.tensor([0, keys_per_table] + [keys_per_table] * 3
                               + [2 * keys_per_table] * 4)
        with torch.no_grad():
            rows = fresh(keys, offsets)
        self.initial = {(i // keys_per_table, k): r
                        for i, (k, r) in enumerate(zip(keys.tolist(), rows))}
        self.rows = {}

    def expired(self, step: int) -> set:
        return {p for p, (last, _) in self.rows.items() if step - last > TTL}

    def step(self, step: int, ids, tables) -> torch.Tensor:
        """Expected output of a training step, then the rows after its backward."""
        for p in self.expired(step) & set(zip(tables, ids.tolist())):
            del self.rows[p]
        out = []
        for t, k in zip(tables, ids.tolist()):
            if (t, k) not in self.rows:
                self.rows[(t, k)] = [step, self.initial[(t, k)].clone()]
            out.append(self.rows[(t, k)][1].clone())
        for t, k in zip(tables, ids.tolist()):  # each lookup's gradient is ones
            self.rows[(t, k)][0] = step
            self.rows[(t, k)][1] = self.rows[(t, k)][1] - LR * torch.ones(DIM)
        return torch.stack(out) if out else torch.empty(0, DIM)


def assert_rows(module, model: RowModel, step: int):
    """export_keys_values: the alive rows exactly (expired ones are never exported)."""
    alive = {p: row for p, (last, row) in model.rows.items() if step - last <= TTL}
    for t, name in enumerate(NAMES):
        got = module.export_keys_values(name)
        mine = {k: r for (tt, k), r in alive.items() if tt == t}
        assert sorted(got.keys.tolist()) == sorted(mine)
        for k, row in zip(got.keys.tolist(), got.embeddings):
            torch.testing.assert_close(row, mine[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("strategy", [S.STEP, S.LRU_LFU], ids=lambda s: s.name)
def test_ttl_against_dict_model(strategy, layout):
    rng = random.Random(hash((strategy.value, layout)) & 0xFFFF)
    module, model = make_module(strategy, layout), RowModel(strategy)
    for step in range(1, 15):  # the group's time is the step: one inserting call a batch
        ids, offsets, tables = batch(rng) if step % 7 else (torch.empty(0, dtype=torch.int64),
                                                           torch.zeros(9, dtype=torch.int64), [])
        expected = model.step(step, ids, tables) if ids.numel() else None
        out = module(ids, offsets)
        if expected is not None:
            torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-7)
        out.backward(torch.ones_like(out))
        assert_rows(module, model, step)
        if step % 5 == 0:  # a sweep frees exactly the expired rows, in every tier
            gone = model.expired(step)
            freed = module.expire()
            assert freed == {name: sum(1 for t, _ in gone if t == i) for i, name in enumerate(NAMES)}
            for p in gone:
                del model.rows[p]
            for name in NAMES:
                assert module.table_size(name) == sum(
                    1 for t, _ in model.rows if NAMES[t] == name)
    metrics = module.cache_metrics()
    assert sum(m.expired for m in metrics.values()) > 0


def test_expired_key_is_admitted_like_a_new_one():
    admit = FrequencyAdmissionStrategy(threshold=2)
    module = make_module(S.STEP, admit=admit)
    def step(keys):
        ids = torch.tensor(keys, dtype=torch.int64)
        offsets = torch.tensor([0, len(keys)] + [len(keys)] * 7)
        out = module(ids, offsets)
        out.backward(torch.ones_like(out))
        return set(module.export_keys_values("a").keys.tolist())

    assert step([5, 5]) == {5}  # seen twice: admitted
    for _ in range(TTL + 1):
        step([])
    assert step([5, 6]) == set()  # 5 expired: once is not enough, as for the new 6
    assert step([5, 6]) == {5, 6}  # second sight: both admitted, fresh rows
    rows = module.export_keys_values("a")
    fresh = make_module(S.STEP, ttl=None)
    with torch.no_grad():
        init = fresh(torch.tensor([5, 6]), torch.tensor([0, 2, 2, 2, 2, 2, 2, 2, 2]))
    order = torch.argsort(rows.keys)
    torch.testing.assert_close(rows.embeddings[order], init - LR)


def test_checkpoint_across_an_expiry(tmp_path):
    """Dump before rows expire, load into a new module: both expire the same rows at
    the same step, and a dump after the expiry holds none of them."""
    rng = random.Random(7)
    a = make_module(S.LRU_LFU, "cache")
    batches = [batch(rng) for _ in range(4)]
    for ids, offsets, _ in batches:
        a(ids, offsets).backward(torch.ones(ids.numel(), DIM))
    DynamicEmbDump(str(tmp_path / "ck"), a)
    b = make_module(S.LRU_LFU, "cache")
    DynamicEmbLoad(str(tmp_path / "ck"), b)
    late = [batch(random.Random(9), keys_per_table=3) for _ in range(TTL + 2)]
    for ids, offsets, _ in late:  # keys >= 3 are never touched again: they expire
        outs = [m(ids, offsets) for m in (a, b)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        for o in outs:
            o.backward(torch.ones_like(o))
    for name in NAMES:
        ka, kb = (sorted(m.export_keys_values(name).keys.tolist()) for m in (a, b))
        assert ka == kb and max(ka, default=0) < 3
    DynamicEmbDump(str(tmp_path / "after"), a)
    c = make_module(S.LRU_LFU)
    DynamicEmbLoad(str(tmp_path / "after"), c)
    assert expire_model(c) == {"a": 0, "b": 0}  # nothing expired was saved
    for name in NAMES:
        assert sorted(c.export_keys_values(name).keys.tolist()) == sorted(
            a.export_keys_values(name).keys.tolist())
    assert sum(expire_model(a).values()) > 0  # a still held them, unswept


def test_table_size_and_clear_table_with_expired_rows():
    """table_size counts alive rows; clear_table removes expired ones too."""
    module = make_module(S.STEP)
    empty = (torch.empty(0, dtype=torch.int64), torch.zeros(9, dtype=torch.int64))
    out = module(torch.arange(6), torch.tensor([0, 3, 3, 3, 3, 6, 6, 6, 6]))
    out.backward(torch.ones_like(out))
    for _ in range(TTL + 1):
        module(*empty)
    assert module.table_size("a") == module.table_size("b") == 0
    module.clear_table("a")
    assert module.expire() == {"a": 0, "b": 3}
