"""Row lifetime on ``ScoredHashTable``: TTL expiry and the LRU_LFU compound score.

TTL: a Hypothesis state machine drives lookups, time steps, sweeps and finds against a
dict model of which rows are alive, what their last access was and what their row
holds (a count of lookups since the row was born: expired rows must come back zeroed,
exactly like new keys). LRU_LFU: the whole-table reference model (``reference_table``)
runs the generic state machine with the compound score, evictions included.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynamicemb import DynamicEmbScoreStrategy as S
from dynamicemb import DynamicEmbTableOptions, ScoredHashTable
from dynamicemb_testing.table_testing import Pair, py_export

from test_hash_table_model import TableVersusModel, table_configs

TTL_STRATEGIES = [S.LRU, S.STEP, S.NO_EVICTION, S.LRU_LFU]
MASK32 = 0xFFFFFFFF


class LifetimeVersusDict(RuleBasedStateMachine):
    """The table with a ttl against {(tid, key): [last access, count, lookups]}.

    Capacity is ample (no eviction), so what survives is decided by the ttl alone.
    Time is the step (STEP) or the clock (one tick per inserting call).
    """

    @initialize(strategy=st.sampled_from(TTL_STRATEGIES), ttl=st.integers(1, 4),
                num_tables=st.integers(1, 2))
    def make(self, strategy, ttl, num_tables):
        self.strategy, self.ttl, self.num_tables = strategy, ttl, num_tables
        self.table = ScoredHashTable(num_tables=num_tables, capacity=512, bucket_capacity=16,
                                     score_strategy=strategy, value_dim=1, ttl=ttl)
        self.model = {}  # (tid, key) -> [last, count, lookups since birth]; expired included
        self.step = 0

    def _now(self) -> int:
        return self.step if self.strategy == S.STEP else self.table.clock

    def _alive(self, at: int) -> dict:
        return {p: v for p, v in self.model.items() if at - v[0] <= self.ttl}

    def _pairs(self, seed: int, n: int):
        rng = random.Random(seed)
        return [(rng.randrange(self.num_tables), rng.randrange(24)) for _ in range(n)]

    @rule(seed=st.integers(0, 2**32), n=st.integers(0, 12))
    def lookup(self, seed, n):
        """find_or_insert of a batch with repeats, then every looked-up row += 1."""
        pairs = self._pairs(seed, n)
        counts = {}
        for p in pairs:
            counts[p] = counts.get(p, 0) + 1
        unique = list(counts)
        keys = torch.tensor([k for _, k in unique], dtype=torch.int64)
        tids = torch.tensor([t for t, _ in unique], dtype=torch.int64)
        given = None
        if self.strategy == S.LRU_LFU:
            given = torch.tensor([counts[p] for p in unique], dtype=torch.int64)
        result = self.table.find_or_insert(keys, tids, given)
        now = self._now()
        alive = self._alive(now)
        expect_new = [p not in alive for p in unique]
        assert result.inserted.tolist() == expect_new
        expect_expired = [p in self.model and p not in alive for p in unique]
        assert result.num_expired == sum(expect_expired)
        # fresh rows are zero, live rows hold their lookups so far
        for p, row, new in zip(unique, self.table.values[result.slots, 0].tolist(), expect_new):
            assert row == (0.0 if new else float(alive[p][2]))
        self.table.values[result.slots, 0] += 1.0
        for p, new in zip(unique, expect_new):
            old = [0, 0, 0] if new else self.model[p]
            self.model[p] = [now, old[1] + counts[p], old[2] + 1]

    @rule(ticks=st.integers(1, 3))
    def advance(self, ticks):
        """Time passes without a lookup: steps, or empty inserting calls (clock ticks)."""
        if self.strategy == S.STEP:
            self.step += ticks
            self.table.set_step(self.step)
        else:
            for _ in range(ticks):
                self.table.find_or_insert(torch.empty(0, dtype=torch.int64))

    @rule()
    def sweep(self):
        gone = self.table.expire()
        alive = self._alive(self._now())
        expired = set(self.model) - set(alive)
        assert set(zip(gone.table_ids.tolist(), gone.keys.tolist())) == expired
        self.model = alive

    @rule(seed=st.integers(0, 2**32), n=st.integers(0, 12))
    def find(self, seed, n):
        pairs = self._pairs(seed, n)
        slots = self.table.find(torch.tensor([k for _, k in pairs], dtype=torch.int64),
                                torch.tensor([t for t, _ in pairs], dtype=torch.int64))
        alive = self._alive(self._now())
        assert [s >= 0 for s in slots.tolist()] == [p in alive for p in pairs]

    @invariant()
    def exports_alive_rows_only(self):
        if not hasattr(self, "table"):
            return
        ex = self.table.export_batch()
        alive = self._alive(self._now())
        got = dict(zip(zip(ex.table_ids.tolist(), ex.keys.tolist()),
                       zip(ex.scores.tolist(), ex.values[:, 0].tolist())))
        assert set(got) == set(alive)
        for p, (score, row) in got.items():
            last, count, lookups = alive[p]
            expect = (count << 32) | last if self.strategy == S.LRU_LFU else last
            assert (score, row) == (expect, float(lookups))
        assert self.table.size() == len(self.model)  # swept rows only leave the count


TestLifetimeVersusDict = LifetimeVersusDict.TestCase
TestLifetimeVersusDict.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


class CompoundVersusModel(TableVersusModel):
    """The generic reference-model state machine, LRU_LFU scores only."""

    @initialize(config=table_configs())
    def make(self, config):
        TableVersusModel.make(self, dict(config, score_strategy="LRU_LFU"))
        assert self.pair.real.score_strategy == S.LRU_LFU == self.pair.ref.strategy.lower()

    def _scores(self, data, n):
        if data.draw(st.booleans()):  # optional counts
            return data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        return None


TestCompoundVersusModel = CompoundVersusModel.TestCase
TestCompoundVersusModel.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_compound_evicts_least_frequent_then_least_recent():
    """One full bucket: the victim is the lowest count, the oldest among equal counts."""
    table = ScoredHashTable(capacity=16, bucket_capacity=16, score_strategy=S.LRU_LFU)
    counts = [3, 1, 2, 1, 5, 1, 4, 2, 3, 6, 2, 7, 8, 9, 4, 5]
    for key, count in enumerate(counts):  # key k is touched at clock k + 1
        table.find_or_insert(torch.tensor([key]), scores=torch.tensor([count]))
    table.find_or_insert(torch.tensor([1]))  # key 1: count 2 now, and recent
    victims = []
    for new_key in (100, 101, 102):
        result = table.find_or_insert(torch.tensor([new_key]))
        victims += result.evicted.keys.tolist()
    # count 1: keys 3 (clock 4) then 5 (clock 6); then count 1 of key 100 (clock 18)
    # is lower than every count 2 (keys 2, 7, 10, 1)
    assert victims == [3, 5, 100]
    scores = dict(zip(*(t.tolist() for t in table.export_batch()[:3:2])))
    assert scores[1] == (2 << 32) | 17


def test_compound_export_min_score_reads_the_time():
    table = ScoredHashTable(capacity=64, bucket_capacity=16, score_strategy=S.LRU_LFU)
    table.find_or_insert(torch.tensor([1, 2]), scores=torch.tensor([50, 1]))  # clock 1
    table.find_or_insert(torch.tensor([3]))  # clock 2
    assert sorted(table.export_batch(min_score=2).keys.tolist()) == [3]
    assert sorted(table.export_batch(min_score=1).keys.tolist()) == [1, 2, 3]


@pytest.mark.parametrize("spelling", [(S.TIMESTAMP, S.LFU), (S.LFU, S.TIMESTAMP), ("lru", "lfu"),
                                      "lru_lfu", S.LRU_LFU])
def test_upstream_compound_spellings(spelling):
    options = DynamicEmbTableOptions(dim=4, max_capacity=64, score_strategy=spelling)
    assert options.score_strategy == S.LRU_LFU


@pytest.mark.parametrize("bad, words", [
    (dict(ttl=0), "ttl must be a positive int"),
    (dict(ttl=-3), "ttl must be a positive int"),
    (dict(ttl=2.5), "ttl must be a positive int"),
    (dict(ttl=True), "ttl must be a positive int"),
    (dict(ttl=5, score_strategy=S.LFU), "ttl=5 needs a score that records the last access"),
    (dict(ttl=5, score_strategy=S.CUSTOMIZED), "score_strategy=CUSTOMIZED"),
    (dict(score_strategy=(S.STEP, S.LFU)), "compound score_strategy"),
    (dict(score_strategy=(S.LRU, S.LFU, S.STEP)), "compound score_strategy"),
])
def test_bad_lifetime_options_are_refused_by_name(bad, words):
    with pytest.raises(ValueError, match=words):
        DynamicEmbTableOptions(dim=4, max_capacity=64, **bad)
    if "ttl" in bad:  # the table refuses it alike
        with pytest.raises(ValueError, match=words):
            ScoredHashTable(capacity=64, **{"score_strategy": S.LRU, **bad})
    assert DynamicEmbTableOptions(dim=4, max_capacity=64).ttl is None


def test_expire_without_ttl_and_state_unchanged_on_bad_input():
    table = ScoredHashTable(capacity=64, bucket_capacity=16)
    table.find_or_insert(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="ttl"):
        table.expire()
    assert table.size() == 2 and sorted(table.export_batch().keys.tolist()) == [1, 2]
    compound = ScoredHashTable(capacity=64, bucket_capacity=16, score_strategy=S.LRU_LFU)
    with pytest.raises(ValueError, match="2\\^32"):
        compound.set_clock(2**32)
    assert compound.clock == 0


def test_expired_hit_in_error_mode_undo_restores_the_old_row():
    """An expired row met by a call that ERROR mode undoes keeps its old score."""
    table = ScoredHashTable(capacity=16, bucket_capacity=16, score_strategy=S.STEP, ttl=1,
                            check_mode="error", value_dim=1)
    table.set_step(1)
    table.find_or_insert(torch.arange(16))
    table.values[:, 0] = 7.0
    table.set_step(5)
    with pytest.raises(RuntimeError):
        table.find_or_insert(torch.arange(17))  # 16 expired hits, then a failed insert
    assert table.export_batch().keys.numel() == 0  # still expired, never revived
    assert table.size() == 16 and table.expire().keys.numel() == 16


def test_sweep_frees_for_reuse_and_finds_stay_exact_after_growth():
    table = ScoredHashTable(capacity=32, bucket_capacity=16, max_capacity=256,
                            score_strategy=S.STEP, ttl=2)
    table.set_step(1)
    table.find_or_insert(torch.arange(100))  # grows
    table.set_step(2)
    table.find_or_insert(torch.arange(50, 150))
    table.set_step(4)
    gone = table.expire()
    assert sorted(gone.keys.tolist()) == list(range(50))
    assert table.size() == 100
    assert (table.find(torch.arange(50)) == -1).all()
    assert (table.find(torch.arange(50, 150)) >= 0).all()
    assert table.stats.expired == 50
