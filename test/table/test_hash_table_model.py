"""The real ``ScoredHashTable`` against the reference model, step by step.

A Hypothesis state machine drives random sequences of every verb on both, over geometries
small enough that full buckets, evictions, growth and reruns after it, and failed inserts are common,
and compares each output and the whole observable state after every step. Directed
scenarios below it pin down the contract's corner cases one at a time.
"""

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dynamicemb_testing.reference_table import keys_in_bucket, ref_hash
from dynamicemb_testing.table_testing import CHECK_MODES, STRATEGIES, Pair, py_export, py_stats

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EXTREME_KEYS = [INT64_MIN, INT64_MIN + 1, -(2**32), -1, 0, 1, 2**32, INT64_MAX - 1, INT64_MAX]


@st.composite
def table_configs(draw) -> dict:
    bc = draw(st.sampled_from([16, 32]))
    nb = draw(st.sampled_from([1, 2, 4]))
    capacity = draw(st.integers(nb // 2 * bc + 1, nb * bc))  # rounds up to nb buckets
    growth = draw(st.sampled_from([1, 1, 2, 4, 8]))
    max_capacity = None if growth == 1 and draw(st.booleans()) else nb * bc * growth - draw(st.integers(0, bc - 1))
    return dict(
        num_tables=draw(st.integers(1, 3)),
        capacity=capacity,
        bucket_capacity=bc,
        score_strategy=draw(st.sampled_from(STRATEGIES)),
        max_load_factor=draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
        max_capacity=max(max_capacity, capacity) if max_capacity is not None else None,
        value_dim=draw(st.sampled_from([0, 3])),
        check_mode=draw(st.sampled_from(CHECK_MODES)),
    )


# (length, seed, hot mask): keys are drawn with random.Random(seed) from the pool keys whose
# hash has (h & hot mask) == 0, so a nonzero mask crowds the batch into a few buckets.
batches = st.tuples(st.integers(0, 64), st.integers(0, 2**32), st.sampled_from([0, 0, 1, 3, 7]))
small_scores = st.integers(0, 12) | st.just(INT64_MAX)


# The state machines run on CPU only: hypothesis drives them outside pytest's fixtures
# (the directed scenarios below run on every backend).
class TableVersusModel(RuleBasedStateMachine):
    """Both tables receive every call; outputs and state must match exactly."""

    @initialize(config=table_configs())
    def make(self, config):
        self.pair = Pair(**config)
        self.config = config
        pool_size = max(24, self.pair.ref.max_capacity() * 5 // 4 // config["num_tables"])
        pool = EXTREME_KEYS + list(range(2, pool_size))
        self.pools = {
            mask: [(t, k) for t in range(config["num_tables"]) for k in pool if ref_hash(t, k) & mask == 0]
            for mask in (0, 1, 3, 7)
        }

    # ------------------------------------------------------------------ helpers
    def _batch(self, batch, dup):
        n, seed, mask = batch
        rng = random.Random(seed)
        pool = self.pools[mask]
        pairs = [pool[rng.randrange(len(pool))] for _ in range(n)]
        tids, keys = [t for t, _ in pairs], [k for _, k in pairs]
        keys, tids = keys + keys[:dup], tids + tids[:dup]  # duplicates inside the batch
        return keys, (None if self.config["num_tables"] == 1 and dup % 2 else tids)

    def _present(self) -> set:
        ex = py_export(self.pair.real.export_batch())
        return set(zip(ex[1], ex[0]))

    def _scores(self, data, n):
        if self.pair.ref.strategy == "LFU" and data.draw(st.booleans()):  # optional counts
            return data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        if self.pair.ref.strategy != "CUSTOMIZED":
            return None
        return data.draw(st.lists(small_scores, min_size=n, max_size=n))

    def _inserting(self, verb, batch, dup, data, seed=0):
        keys, tids = self._batch(batch, dup)
        rows = None
        if verb != "find_or_insert":
            rows = [[float(seed + 3 * r + i) for i in range(self.pair.dim)] for r in range(len(keys))]
        before, evictions_before = self._present(), self.pair.real.stats.evictions
        out = self.pair.check(verb, keys, tids, rows=rows, scores=self._scores(data, len(keys)))
        after = self._present()
        vanished, appeared = before - after, after - before
        batch_pairs = set(zip(tids or [0] * len(keys), keys))
        assert appeared <= batch_pairs
        if out is None:  # ERROR mode undid the call
            assert isinstance(self.pair.last_error, RuntimeError) and self.config["check_mode"] == "ERROR"
            assert not vanished and not appeared
        elif verb == "insert_or_assign":
            assert out[2] is None
            # a victim may come back later in the same batch, so "<="
            assert len(vanished) <= self.pair.real.stats.evictions - evictions_before
        else:
            ev_keys, ev_tids = out[2][0], out[2][1]
            assert vanished == set(zip(ev_tids, ev_keys)) - after
            assert vanished <= set(zip(ev_tids, ev_keys))

    # ------------------------------------------------------------------ rules
    @rule(batch=batches, dup=st.integers(0, 6))
    def find(self, batch, dup):
        before = py_export(self.pair.real.export_batch())
        keys, tids = self._batch(batch, dup)
        self.pair.check("find", keys, tids)
        assert py_export(self.pair.real.export_batch()) == before  # read-only, scores included

    @rule(batch=batches, dup=st.integers(0, 6), data=st.data())
    def find_or_insert(self, batch, dup, data):
        self._inserting("find_or_insert", batch, dup, data)

    @rule(batch=batches, dup=st.integers(0, 6), data=st.data(), seed=st.integers(-500, 500))
    def insert_or_assign(self, batch, dup, data, seed):
        self._inserting("insert_or_assign", batch, dup, data, seed)

    @rule(batch=batches, dup=st.integers(0, 6), data=st.data(), seed=st.integers(-500, 500))
    def insert_and_evict(self, batch, dup, data, seed):
        self._inserting("insert_and_evict", batch, dup, data, seed)

    @rule(batch=batches, dup=st.integers(0, 3), data=st.data())
    def erase(self, batch, dup, data):
        keys, tids = self._batch(batch, dup)
        present = sorted(self._present())
        if present:  # mostly keys that are there
            picks = data.draw(st.lists(st.sampled_from(present), max_size=12))
            tids = (tids or [0] * len(keys)) + [t for t, _ in picks]
            keys = keys + [k for _, k in picks]
        before = self._present()
        out = self.pair.check("erase", keys, tids)
        gone = {(t, k) for t, k, ok in zip(tids or [0] * len(keys), keys, out) if ok}
        assert before - self._present() == gone and len(gone) == sum(out)

    @rule(start=st.integers(0, 300), count=st.none() | st.integers(0, 300), min_score=st.none() | small_scores)
    def export_batch(self, start, count, min_score):
        real = py_export(self.pair.real.export_batch(start, count, min_score))
        assert real == tuple(self.pair.ref.export_batch(start, count, min_score))

    @rule(step=small_scores)
    def set_step(self, step):
        self.pair.real.set_step(step)
        self.pair.ref.set_step(step)

    @rule(coin=st.integers(0, 3))
    def clear(self, coin):
        if coin == 0:  # rare: it undoes the work that makes the other rules interesting
            self.pair.real.clear()
            self.pair.ref.clear()
            assert self.pair.real.size() == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def same_state(self):
        self.pair.assert_same_state()
        real = self.pair.real
        assert real.size() <= real.capacity() <= real.max_capacity() == self.pair.ref.max_capacity()
        assert real.size() == len(real.export_batch().keys)
        assert tuple(real.values.shape) == (real.capacity(), self.pair.dim)


@st.composite
def error_mode_configs(draw) -> dict:
    """ERROR mode on one or two small buckets that may grow 2-4x: failures there come after
    a growth, so the undo must keep the grown layout."""
    config = draw(table_configs())
    bc, nb = config["bucket_capacity"], draw(st.sampled_from([1, 2]))
    config.update(check_mode="ERROR", capacity=nb * bc, max_capacity=nb * bc * draw(st.sampled_from([2, 4])))
    return config


class ErrorModeVersusModel(TableVersusModel):
    """The same machine, always in ERROR mode and near the growth limit."""

    @initialize(config=error_mode_configs())
    def make(self, config):
        super().make(config)


def machine_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        # HYPOTHESIS_NO_SHRINK=1 reports the first failure as found (shrinking can take minutes)
        phases=[p for p in Phase if not (os.environ.get("HYPOTHESIS_NO_SHRINK") and p is Phase.shrink)],
        stateful_step_count=30,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


TableVersusModel.TestCase.settings = machine_settings(150)
ErrorModeVersusModel.TestCase.settings = machine_settings(60)
test_table_versus_model = TableVersusModel.TestCase
test_error_mode_versus_model = ErrorModeVersusModel.TestCase


# ---------------------------------------------------------------------- directed scenarios
def small_pair(device, **kw) -> Pair:
    kw.setdefault("capacity", 16)
    kw.setdefault("bucket_capacity", 16)
    kw.setdefault("max_load_factor", 1.0)
    return Pair(device=device, **kw)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("verb", ["find_or_insert", "insert_or_assign", "insert_and_evict"])
def test_clock_advances_once_per_inserting_call(strategy, verb, device):
    p = small_pair(device, score_strategy=strategy)
    scores = [4, 4, 4] if strategy == "CUSTOMIZED" else None
    rows = [[]] * 3 if verb != "find_or_insert" else None
    for _ in range(3):
        p.check(verb, [1, 2, 1], rows=rows, scores=scores)
    p.check("find", [1, 2, 3])
    p.check("erase", [2])
    assert p.real.clock == 3
    p.assert_same_state()


@pytest.mark.parametrize("strategy", STRATEGIES + ["LFU-counts"])
def test_duplicates_in_one_batch(strategy, device):
    scores = [3, 9, 1, 5] if strategy in ("CUSTOMIZED", "LFU-counts") else None
    strategy = strategy.split("-")[0]
    p = small_pair(device, score_strategy=strategy, value_dim=2)
    p.real.set_step(7)
    p.ref.set_step(7)
    out = p.check("insert_and_evict", [5, 6, 5, 5], rows=[[1, 1], [2, 2], [3, 3], [4, 4]], scores=scores)
    assert out[0][0] == out[0][2] == out[0][3] and out[1] == [True, True, False, False]
    if strategy == "LFU":  # counts add up per occurrence, default 1
        assert p.real.export_batch().scores.tolist() == ([9, 9] if scores else [3, 1])
    p.assert_same_state()


def test_eviction_victim_min_score_lowest_slot_and_pinned_skipped(device):
    p = small_pair(device, score_strategy="CUSTOMIZED", value_dim=1)
    p.check("insert_or_assign", list(range(16)), rows=[[i] for i in range(16)], scores=[5] * 16)
    p.check("find_or_insert", [3, 9], scores=[1, 1])
    # 100 evicts slot 3 (lowest of the two minima); 101 evicts 9; 102 finds only score-5 slots,
    # the lowest of which is slot 0; 100's own slot is pinned.
    out = p.check("insert_and_evict", [100, 101, 102], rows=[[7], [8], [9]], scores=[0, 0, 0])
    assert out[0] == [3, 9, 0] and out[2][0] == [3, 9, 0] and out[2][4] == [(3.0,), (9.0,), (0.0,)]
    p.assert_same_state()


def test_all_pinned_bucket_fails(device):
    p = small_pair(device, score_strategy="LRU")
    out = p.check("find_or_insert", list(range(17)))
    assert out[0][16] == -1 and p.real.stats.failed_inserts == 1
    p.assert_same_state()


def test_a_full_bucket_grows_the_table_and_the_call_runs_again(device):
    p = small_pair(device, max_capacity=64)
    full = keys_in_bucket(0, 1, 16)
    p.check("find_or_insert", full)
    p.check("erase", full[:3:2])  # holes at offsets 0 and 2
    out = p.check("find_or_insert", [10**6, 10**6 + 1, full[5], 10**6 + 2])
    assert [s % 16 for s in out[0][:2]] == [0, 2] and out[1] == [True, True, False, True]
    assert p.real.capacity() == 32 and p.real.stats.growths == 1
    p.assert_same_state()
    b0 = keys_in_bucket(0, 2, 17, start=10**7)  # overfills bucket 0 of 2: another growth
    p.check("find_or_insert", b0)
    p.assert_same_state()
    ex = py_export(p.real.export_batch())
    for k, t, s in zip(ex[0], ex[1], ex[3]):
        assert s // 16 == ref_hash(t, k) & (p.real.num_buckets - 1)


def test_a_hit_after_a_full_bucket_gets_its_slot_after_growth(device):
    p = small_pair(device, max_capacity=32, score_strategy="LFU")
    full = keys_in_bucket(0, 1, 16)
    p.check("find_or_insert", full)
    out = p.check("find_or_insert", [123456, full[0]])
    assert out[0][1] == (ref_hash(0, full[0]) & 1) * 16
    p.assert_same_state()


def test_load_factor_growth_happens_before_the_call(device):
    p = small_pair(device, capacity=32, max_capacity=128, max_load_factor=0.5)
    p.check("find_or_insert", list(range(17)))
    assert p.real.capacity() == 32
    p.check("find_or_insert", [])
    assert p.real.capacity() == 64
    p.assert_same_state()


@pytest.mark.parametrize("verb", ["find_or_insert", "insert_or_assign", "insert_and_evict"])
def test_error_mode_undo_keeps_growth(verb, device):
    p = small_pair(device, max_capacity=32, check_mode="ERROR", value_dim=1, score_strategy="STEP")
    b0 = keys_in_bucket(0, 2, 40)
    p.check("insert_or_assign", b0[:16], rows=[[i] for i in range(16)])
    before = {(k, s % 16, v) for k, s, v in zip(*[py_export(p.real.export_batch())[i] for i in (0, 3, 4)])}
    rows = [[9.0]] * 24 if verb != "find_or_insert" else None
    assert p.check(verb, b0[16:], rows=rows) is None
    assert isinstance(p.last_error, RuntimeError)
    after = py_export(p.real.export_batch())
    assert {(k, s % 16, v) for k, s, v in zip(after[0], after[3], after[4])} == before
    assert p.real.capacity() == 32 and py_stats(p.real.stats)["growths"] == 1
    assert p.real.clock == 1
    p.assert_same_state()


def test_find_or_insert_zeroes_inserted_rows_only(device):
    p = small_pair(device, value_dim=2, value_dtype=torch.float64)
    p.check("insert_or_assign", [1, 2], rows=[[1.5, 2.5], [3.5, 4.5]])
    p.check("erase", [2])
    out = p.check("find_or_insert", [2, 1])
    assert p.real.values[out[0][0]].tolist() == [0.0, 0.0]
    assert p.real.values[out[0][1]].tolist() == [1.5, 2.5]
    p.assert_same_state()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("verb", ["find_or_insert", "insert_or_assign", "insert_and_evict"])
def test_empty_batch_is_a_valid_call(strategy, verb, device):
    p = small_pair(device, score_strategy=strategy, value_dim=2)
    p.check("find_or_insert", [1, 2], scores=[1, 1] if strategy == "CUSTOMIZED" else None)
    scores = [] if strategy == "CUSTOMIZED" else None
    out = p.check(verb, [], rows=[] if verb != "find_or_insert" else None, scores=scores)
    assert p.last_error is None and out[0] == [] and p.real.clock == 2
    p.assert_same_state()


def test_hit_pins_its_slot_against_later_keys_of_the_batch(device):
    p = small_pair(device, score_strategy="CUSTOMIZED")
    keys = list(range(16))
    p.check("find_or_insert", keys, scores=[1] + [5] * 15)
    # key 0 keeps the minimum score, but its hit pinned it: 100 must evict slot 1
    out = p.check("insert_and_evict", [0, 100], rows=[[], []], scores=[0, 9])
    assert out[0] == [0, 1] and out[2][0] == [1]
    p.assert_same_state()


def test_a_rerun_after_growth_pins_a_hit_only_at_its_turn(device):
    # The call that found bucket 0 full is undone and runs again after the growth (now at
    # max capacity): the new key comes first and may evict the hit key, which then comes
    # back as an insert.
    p = small_pair(device, max_capacity=32, score_strategy="CUSTOMIZED")
    b0 = keys_in_bucket(0, 2, 17)  # bucket 0 after the growth as well
    p.check("find_or_insert", b0[:16], scores=[1] + [5] * 15)
    out = p.check("insert_and_evict", [b0[16], b0[0]], rows=[[], []], scores=[9, 9])
    assert p.real.capacity() == 32
    assert out[0] == [0, 1] and out[1] == [True, True]
    assert out[2][0] == [b0[0], b0[1]]
    p.assert_same_state()


@pytest.mark.parametrize("extra, grows", [(0, False), (1, True)])
def test_load_factor_growth_is_strictly_above(extra, grows, device):
    p = small_pair(device, capacity=32, max_capacity=128, max_load_factor=0.5)
    p.check("find_or_insert", list(range(16 + extra)))
    p.check("find_or_insert", [0])
    assert p.real.capacity() == (64 if grows else 32)
    p.assert_same_state()


@pytest.mark.parametrize("mode", CHECK_MODES)
def test_check_mode_on_failure(mode, caplog, device):
    p = small_pair(device, score_strategy="NO_EVICTION", check_mode=mode)
    p.check("find_or_insert", list(range(16)))
    with caplog.at_level("WARNING"):
        out = p.check("find_or_insert", [100, 3, 101])
    warned = any(r.levelname == "WARNING" for r in caplog.records)
    if mode == "ERROR":
        assert out is None and isinstance(p.last_error, RuntimeError)
    else:
        assert out[0] == [-1, 3, -1] and p.last_error is None
    assert warned == (mode == "WARNING")
    assert p.real.stats.failed_inserts == 2
    p.assert_same_state()
