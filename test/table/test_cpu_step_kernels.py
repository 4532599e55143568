"""The CPU extension's step verbs against the CUDA kernels (as emulated).

``dedup_upsert``, ``dedup``, ``upsert``, ``erase_where`` and
``init_rows`` of the CPU extension must return what ``CudaKernels`` returns for the
same arguments, bit for bit (padding past the unique count included), and leave twin
tables, clocks and counters in the same state: on random batches with duplicates,
sizes 0 and 1, full buckets with and without eviction, every score rule (the given
rule by table scores), a ttl, a refused batch (error word set) and a ``BatchPart``.
Entries a kernel leaves unwritten (``prev_scores`` of evictions and failures, the
victims' fields but for evictions) are compared where they are defined.

A step's call with a ttl or CUSTOMIZED scores must also decide what the table's own
verb decides over the deduplicated keys (``prepare_find_or_insert``): same slots, new
keys, table bytes and stats (``test_step_call_matches_the_table_verb``).
"""

import random

import pytest
import torch

from dynamicemb.ops import cpu_kernels
from dynamicemb.ops.cpu import CpuBackend
from dynamicemb.ops.records import BatchPart, InitSpec
from dynamicemb_testing.cuda_emulation import emulated_cuda

HIT, INSERTED, EVICTED, FAILED = 0, 1, 2, 3
EXPIRED = 4  # where the inserting verbs count hits on expired rows
NO_BUCKET = 0x7FFFFFFF
RULES = [0, 1, 2, 3]  # clock, count, given, count then clock


def new_table(num_buckets: int, bc: int):
    return CpuBackend().new_table(num_buckets=num_buckets, max_num_buckets=num_buckets,
                                  bucket_capacity=bc, value_dim=4, value_dtype=torch.float32,
                                  device=torch.device("cpu"))


def twin(memory):
    """A table of the same shape holding the same bytes."""
    other = new_table(memory.num_buckets, memory.bucket_capacity)
    for mine, theirs in zip(other.meta, memory.meta):
        mine.copy_(theirs)
    return other


def assert_same_tables(a, b, what: str) -> None:
    for name, x, y in zip(("keys", "scores", "tids", "digests", "occupied", "pinned"),
                          a.meta, b.meta):
        assert torch.equal(x, y), f"{what}: table {name} differ"


def assert_same(got, want, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}")
    assert torch.equal(got, want), f"{what} differ:\n{got}\n{want}"


def assert_same_pass(got, want, what: str) -> None:
    """(slots, status, prev_scores, ev_keys, ev_tids, ev_scores), each where written."""
    slots, status = want[0], want[1]
    assert_same(got[0], slots, f"{what} slots")
    assert_same(got[1], status, f"{what} status")
    # a hit's old score; an insert's -1, or an expired row's old score
    recorded, evicted = (status == HIT) | (status == INSERTED), status == EVICTED
    assert_same(got[2][recorded], want[2][recorded], f"{what} prev_scores")
    for i, name in ((3, "ev_keys"), (4, "ev_tids"), (5, "ev_scores")):
        assert got[i].dtype == want[i].dtype and got[i].shape == want[i].shape, name
        assert_same(got[i][evicted], want[i][evicted], f"{what} {name}")


def batch(rng: random.Random, n: int, pool: int, tables: int):
    keys = torch.tensor([rng.randrange(pool) - pool // 4 for _ in range(n)], dtype=torch.int64)
    tids = torch.tensor([rng.randrange(tables) for _ in range(n)], dtype=torch.int16)
    return keys, tids


def maybe_part(rng: random.Random, n: int, with_part: bool):
    if not with_part:
        return None
    return BatchPart(torch.tensor([rng.randrange(3) for _ in range(n)], dtype=torch.int64), 1)


class Twins:
    """A table for the CPU verb and its twin for the emulated CUDA kernel, with
    their clocks and counters."""

    def __init__(self, num_buckets: int, bc: int) -> None:
        self.cpu = new_table(num_buckets, bc)
        self.gpu = twin(self.cpu)
        self.bc = bc
        self.state = {side: dict(time=torch.tensor([5, 2], dtype=torch.int64),
                                 outcomes=torch.zeros(5, dtype=torch.int64),
                                 size=torch.zeros(1, dtype=torch.int64),
                                 erased=torch.zeros(1, dtype=torch.int64))
                      for side in ("cpu", "gpu")}

    def check(self, what: str) -> None:
        assert_same_tables(self.cpu, self.gpu, what)
        for name in ("time", "outcomes", "size", "erased"):
            assert_same(self.state["cpu"][name], self.state["gpu"][name], f"{what}: {name}")
        assert int(self.state["cpu"]["size"]) == int(
            (self.cpu.meta[3] != 0).sum()), f"{what}: size counts the occupied slots"
        assert int(self.cpu.meta[5].count_nonzero()) == 0, f"{what}: a slot stays pinned"


def run_both(twins: Twins, kernels, verb: str, make_args):
    """verb(*make_args(memory, state)) on the CPU extension and on the emulation."""
    cpu = getattr(cpu_kernels.load(), verb)(*make_args(twins.cpu, twins.state["cpu"]))
    gpu = getattr(kernels, verb)(*make_args(twins.gpu, twins.state["gpu"]))
    return cpu, gpu


TABLE_SCORES = torch.tensor([7, 3, 11], dtype=torch.int64)  # the given rule's, by table


def dedup_upsert_args(keys, tids, frequencies, rule, now_index, evicts, one_table, error, part,
                      ttl=0):
    table_scores = TABLE_SCORES if rule == 2 else None

    def make(memory, state):
        return (memory.meta, memory.bucket_capacity, keys, tids, frequencies, rule,
                state["time"], now_index, evicts, one_table, error, state["outcomes"],
                state["size"], part, table_scores, ttl)
    return make


def assert_same_dedup_upsert(got, want, what: str) -> None:
    assert len(got) == len(want) == 12, what
    for i, name in enumerate(("ukeys", "utids", "inverse", "counts", "starts", "rank")):
        assert_same(got[i], want[i], f"{what} {name}")
    assert_same_pass(got[6:], want[6:], what)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("evicts", [True, False], ids=["evicts", "no-eviction"])
@pytest.mark.parametrize("seed,ttl", [(0, 0), (1, 0), (0, 2), (1, 3)])
def test_dedup_upsert_matches_cuda(rule, evicts, seed, ttl):
    """Calls in sequence (the table fills, then evicts or fails), of sizes 0, 1 and
    more, with frequencies or not, an error word clear or set, a part or none, and
    a ttl or none (the clock rules then find expired rows)."""
    rng = random.Random(f"{rule}{evicts}{seed}{ttl}")
    twins = Twins(num_buckets=4, bc=16)
    with emulated_cuda() as kernels:
        for call, n in enumerate([0, 1, 7, 40, 0, 90, 1, 150, 64]):
            keys, tids = batch(rng, n, pool=160, tables=3)
            one_table = call % 3 == 2
            if one_table:
                tids.zero_()
            frequencies = (torch.tensor([rng.randrange(1, 4) for _ in range(n)], dtype=torch.int64)
                           if call % 2 else None)
            refused = call in (4, 6) or (call == 7 and seed == 1)
            error = None if call % 4 == 1 and not refused else torch.tensor([int(refused)])
            part = maybe_part(rng, n, with_part=call % 3 == 1)
            args = dedup_upsert_args(keys, tids, frequencies, rule, call % 2, evicts,
                                     one_table, error, part, ttl)
            got, want = run_both(twins, kernels, "dedup_upsert", args)
            what = f"call {call} (n={n}, refused={refused}, part={part is not None})"
            assert_same_dedup_upsert(got, want, what)
            twins.check(what)
            if refused:
                assert (got[7] == FAILED).all() and (got[2] == -1).all(), what
    outcomes = twins.state["cpu"]["outcomes"].tolist()
    assert outcomes[EVICTED if evicts else FAILED] > 0, "the calls filled a bucket"
    assert outcomes[HIT] + outcomes[EXPIRED] > 0 and outcomes[INSERTED] > 0
    if ttl and rule in (0, 3):  # the rules whose scores record the time
        assert outcomes[EXPIRED] > 0, "some hit found its row expired"


def test_dedup_upsert_threads():
    """Batches large enough for the overlapped dedup and pass (two threads), every rule,
    some with a part."""
    rng = random.Random(7)
    twins = Twins(num_buckets=64, bc=128)
    with emulated_cuda() as kernels:
        for rule, n in ((0, 6000), (1, 9000), (2, 7001), (3, 5000), (0, 8191)):
            keys, tids = batch(rng, n, pool=12000, tables=2)
            frequencies = torch.tensor([rng.randrange(1, 3) for _ in range(n)], dtype=torch.int64)
            part = maybe_part(rng, n, with_part=rule in (1, 2))
            args = dedup_upsert_args(keys, tids, frequencies, rule, 0, True, False,
                                     torch.zeros(1, dtype=torch.int64), part, ttl=rule)
            got, want = run_both(twins, kernels, "dedup_upsert", args)
            assert_same_dedup_upsert(got, want, f"rule {rule}")
            twins.check(f"rule {rule}")


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped-timed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dedup_matches_cuda(seed, grouped):
    """Plain, or (an admission's dedup) grouped, with frequencies, advancing a
    table's time unless the batch is refused."""
    rng = random.Random(seed)
    with emulated_cuda() as kernels:
        for call, n in enumerate([0, 1, 2, 30, 500]):
            keys, tids = batch(rng, n, pool=max(2, n // 2), tables=2)
            error = [None, torch.zeros(1, dtype=torch.int64),
                     torch.tensor([3])][(call + seed) % 3]
            part = maybe_part(rng, n, with_part=(call + seed) % 2 == 1)
            kw = {}
            if grouped:
                freq = torch.tensor([rng.randrange(1, 5) for _ in range(n)], dtype=torch.int64)
                kw = dict(frequencies=freq, group=True)
            times = [torch.tensor([5, 9]) for _ in range(2)]
            got = cpu_kernels.load().dedup(keys, tids, error, part,
                                                  time=times[0] if grouped else None, **kw)
            want = kernels.dedup(keys, tids, error, part,
                                        time=times[1] if grouped else None, **kw)
            assert len(got) == len(want) == 6
            for i, name in enumerate(("ukeys", "utids", "inverse", "counts", "starts", "rank")):
                assert_same(got[i], want[i], f"call {call} {name}")
            assert got[4].numel() == (n + 1 if grouped else 0)
            ticked = grouped and (error is None or int(error) == 0)
            assert times[0].tolist() == times[1].tolist() == ([6, 10] if ticked else [5, 9])


def unique_batch(rng: random.Random, n: int, pool: int, num_buckets: int):
    """Unique keys (table 0..1) with their buckets, some positions padding."""
    pairs = rng.sample([(k, t) for k in range(pool) for t in range(2)], n)
    keys = torch.tensor([k for k, _ in pairs], dtype=torch.int64)
    tids = torch.tensor([t for _, t in pairs], dtype=torch.int16)
    hashes = cpu_kernels.load().hash_keys(keys, tids)
    buckets = torch.bitwise_and(hashes, num_buckets - 1).to(torch.int32)
    padding = torch.tensor([rng.random() < 0.2 for _ in range(n)], dtype=torch.bool)
    return keys, tids, torch.where(padding, NO_BUCKET, buckets).to(torch.int32)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("evicts", [True, False], ids=["evicts", "no-eviction"])
def test_upsert_matches_cuda(rule, evicts):
    rng = random.Random(f"{rule}{evicts}")
    twins = Twins(num_buckets=4, bc=16)
    with emulated_cuda() as kernels:
        for call, n in enumerate([0, 1, 30, 60, 100]):
            keys, tids, buckets = unique_batch(rng, n, pool=120, num_buckets=4)
            scores = torch.tensor([rng.randrange(1, 1000) for _ in range(n)], dtype=torch.int64)
            one_table = call == 3
            if one_table:  # every table id 0: the pairs of table 1 stand aside
                keep = tids == 0
                keys, tids, buckets, scores = keys[keep], tids[keep], buckets[keep], scores[keep]

            # the call's time from a table's (clock, step), or 0 without one
            time = None if call == 0 else torch.tensor([40 + call, 7 * call])

            def make(memory, state):
                return (memory.meta, memory.bucket_capacity, keys, tids, scores, rule, evicts,
                        one_table, buckets, state["outcomes"], state["size"], time, call % 2)
            got, want = run_both(twins, kernels, "upsert", make)
            assert len(got) == len(want) == 6
            assert_same_pass(got, want, f"call {call}")
            assert (got[0][buckets == NO_BUCKET] == -1).all()
            twins.check(f"call {call}")
    assert twins.state["cpu"]["outcomes"][EVICTED if evicts else FAILED] > 0


@pytest.mark.parametrize("evicts", [True, False], ids=["evicts", "no-eviction"])
def test_upsert_threads_with_one_thread_owning_most_keys(evicts):
    """A pass large enough for two threads (each owns half the buckets) whose keys fall
    mostly in the first thread's half: its list of keys outgrows its share, and its
    buckets fill (evictions or failures), while the other thread has few keys. Repeated
    keys hit their first occurrence's slot."""
    rng = random.Random(11)
    num_buckets, n = 64, 6000
    candidates = torch.tensor(rng.sample(range(1 << 40), 4 * n), dtype=torch.int64)
    tids = torch.zeros(candidates.numel(), dtype=torch.int16)
    first_half = torch.bitwise_and(cpu_kernels.load().hash_keys(candidates, tids),
                                   num_buckets - 1) < num_buckets // 2
    keys = torch.cat([candidates[first_half][:n * 9 // 10], candidates[~first_half][:n // 10]])
    keys = keys[torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(3))]
    keys[::50] = keys[1::50]  # some keys twice
    tids = torch.zeros(keys.numel(), dtype=torch.int16)
    scores = torch.arange(keys.numel(), dtype=torch.int64) % 997 + 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        twins = Twins(num_buckets=num_buckets, bc=128)
        with emulated_cuda() as kernels:
            # inserts; then, in the reverse order, hits, and for the keys the full
            # buckets refused, evictions of rows not yet hit (or failures)
            for call, order in enumerate((keys, keys.flip(0))):
                def make(memory, state, order=order):
                    return (memory.meta, memory.bucket_capacity, order, tids, scores, 0, evicts,
                            True, None, state["outcomes"], state["size"], None, 0)
                got, want = run_both(twins, kernels, "upsert", make)
                assert_same_pass(got, want, f"call {call}")
                twins.check(f"call {call}")
    finally:
        torch.set_num_threads(threads)
    outcomes = twins.state["cpu"]["outcomes"]
    assert outcomes[HIT] > 0 and outcomes[EVICTED if evicts else FAILED] > 0


@pytest.mark.parametrize("which", [HIT, INSERTED, EVICTED, FAILED])
def test_erase_where_matches_cuda(which):
    """Erases the keys of one status of a step's call (victims: from a second table,
    as the host store's victims leave the cache)."""
    rng = random.Random(which)
    twins = Twins(num_buckets=4, bc=16)
    with emulated_cuda() as kernels:
        for call, n in enumerate([40, 0, 1, 120, 80]):
            keys, tids = batch(rng, n, pool=150, tables=2)
            args = dedup_upsert_args(keys, tids, None, 0, 0, True, False, None, None)
            result, _ = run_both(twins, kernels, "dedup_upsert", args)
            status = result[7]
            erase_keys, erase_tids = ((result[9], result[10]) if which == EVICTED
                                      else (result[0], result[1]))

            def make(memory, state):
                return (memory.meta, memory.bucket_capacity, erase_keys, erase_tids, status,
                        which, state["erased"], state["size"])
            run_both(twins, kernels, "erase_where", make)
            twins.check(f"call {call}")
    if which in (HIT, INSERTED):
        assert int(twins.state["cpu"]["erased"]) > 0


INIT_SPECS = [  # (stream, mode, seed), (mean, std_dev, lower, upper, value)
    ((0, 0, 11), (0.5, 2.0, -1.0, 1.0, 0.0)),  # normal
    ((3, 1, 12), (0.0, 1.0, -0.5, 0.5, 0.0)),  # truncated normal
    ((1, 2, 13), (0.0, 1.0, -0.1, 0.3, 0.0)),  # uniform
    ((2, 3, 14), (0.0, 1.0, 0.0, 1.0, 0.25)),  # constant
    ((4, 4, 15), (0.0, 1.0, 0.0, 1.0, 0.0)),  # debug
]


@pytest.mark.parametrize("dim,width", [(4, 4), (3, 9)])
def test_init_rows_matches_cuda(dim, width):
    """Rows of new keys (inserted, evicted and inserted) get [initializer | state];
    hits, failures and padding keep their rows."""
    rng = random.Random(dim)
    spec = InitSpec(torch.tensor([ints for ints, _ in INIT_SPECS], dtype=torch.int64),
                    torch.tensor([floats for _, floats in INIT_SPECS], dtype=torch.float32))
    n = 300
    keys = torch.tensor([rng.randrange(-1000, 10**12) for _ in range(n)], dtype=torch.int64)
    tids = torch.tensor([rng.randrange(len(INIT_SPECS)) for _ in range(n)], dtype=torch.int16)
    slots = torch.randperm(400, generator=torch.Generator().manual_seed(dim))[:n]
    status = torch.tensor([rng.choice([HIT, INSERTED, EVICTED, FAILED]) for _ in range(n)],
                          dtype=torch.int8)
    before = torch.randn(400, width, generator=torch.Generator().manual_seed(1))
    got, want = before.clone(), before.clone()
    cpu_kernels.load().init_rows(got, slots, status, keys, tids, dim, spec, 0.125)
    with emulated_cuda() as kernels:
        kernels.init_rows(want, slots, status, keys, tids, dim, spec, 0.125)
    assert_same(got, want, "values")
    new = (status == INSERTED) | (status == EVICTED)
    untouched = torch.ones(400, dtype=torch.bool)
    untouched[slots[new]] = False
    assert torch.equal(got[untouched], before[untouched])
    assert (got[slots[new], dim:] == 0.125).all()
    every, every_cuda = before.clone(), before.clone()  # no status: every key's row
    cpu_kernels.load().init_rows(every, slots, None, keys, tids, dim, spec, 0.5)
    with emulated_cuda() as kernels:
        kernels.init_rows(every_cuda, slots, None, keys, tids, dim, spec, 0.5)
    assert_same(every, every_cuda, "values of every key")
    assert torch.equal(every[slots, :dim][new], got[slots[new], :dim])
    assert (every[slots, dim:] == 0.5).all()
    empty = torch.empty(0, dtype=torch.int64)
    cpu_kernels.load().init_rows(got, empty, empty.to(torch.int8), empty,
                                     empty.to(torch.int16), dim, spec, 0.0)


def test_bad_arguments_raise():
    memory = new_table(4, 16)
    kernels = cpu_kernels.load()
    keys, tids = torch.arange(5), torch.zeros(5, dtype=torch.int16)
    outcomes, size = torch.zeros(5, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    def call(time=torch.zeros(2, dtype=torch.int64), now_index=0, rule=0, part=None,
             error=None, table_scores=None, ttl=0, counts=outcomes):
        kernels.dedup_upsert(memory.meta, 16, keys, tids, None, rule, time, now_index,
                                    True, False, error, counts, size, part, table_scores, ttl)

    with pytest.raises(RuntimeError, match="time holds a clock and a step"):
        call(time=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="now_index"):
        call(now_index=2)
    with pytest.raises(RuntimeError, match="unknown score rule"):
        call(rule=7)
    with pytest.raises(RuntimeError, match="part.groups"):
        call(part=BatchPart(torch.zeros(4, dtype=torch.int64), 0))
    with pytest.raises(RuntimeError, match="error word"):
        call(error=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="table_scores"):
        call(rule=2)
    with pytest.raises(RuntimeError, match="table_scores"):
        call(rule=2, table_scores=torch.zeros(0, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="ttl must be >= 0"):
        call(ttl=-1)
    with pytest.raises(RuntimeError, match="outcomes must hold 5"):
        call(counts=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="buckets"):
        kernels.upsert(memory.meta, 16, keys, tids, None, 0, True, False,
                              torch.zeros(4, dtype=torch.int32), outcomes, size)
    with pytest.raises(RuntimeError, match="need scores"):
        kernels.upsert(memory.meta, 16, keys, tids, None, 1, True, False,
                              torch.zeros(5, dtype=torch.int32), outcomes, size)
    assert int(outcomes.sum()) == 0 and int(size) == 0, "a refused call changed counts"


# ----------------------------------------- a step's call against the table's own verb
def _tables(strategy, ttl):
    from dynamicemb.table import ScoredHashTable
    return [ScoredHashTable(num_tables=3, capacity=64, bucket_capacity=16,
                            score_strategy=strategy, ttl=ttl) for _ in range(2)]


STEP_CASES = {  # strategy, ttl
    "lru-ttl": ("LRU", 2), "step-ttl": ("STEP", 3), "lru_lfu-ttl": ("LRU_LFU", 2),
    "no_eviction-ttl": ("NO_EVICTION", 2), "customized": ("CUSTOMIZED", None),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_step_call_matches_the_table_verb(case):
    """``prepare_dedup_find_or_insert()`` with a ttl (hits on expired rows are
    inserts the kernel finds at the time it keeps on the device) or CUSTOMIZED
    scores (each table's score read by table id) decides what the table's own
    ``prepare_find_or_insert`` of the deduplicated keys decides: slots, new keys
    (expired hits included), scores, table bytes, size and stats; ``find`` then
    misses the same expired rows."""
    from dynamicemb.types import DynamicEmbScoreStrategy as S
    name, ttl = STEP_CASES[case]
    strategy = S[name]
    verb, step = _tables(strategy, ttl)
    rng = random.Random(case)
    customized = strategy == S.CUSTOMIZED
    counted = strategy in (S.LFU, S.LRU_LFU)
    for call in range(14):
        n = rng.choice([1, 20, 60, 90])
        keys, tids = batch(rng, n, pool=40 + 20 * (call % 3), tables=3)
        freq = torch.tensor([rng.randrange(1, 4) for _ in range(n)], dtype=torch.int64)
        scores = (torch.tensor([rng.randrange(0, 50) for _ in range(3)], dtype=torch.int64)
                  if customized else None)
        if strategy == S.STEP:
            verb.set_step(call + 1)  # the step's call advances its step on the device
        unique = verb._ops.dedup(keys=keys, table_ids=tids, error=None, frequencies=freq)
        u = int((unique.counts > 0).sum())
        ukeys, utids = unique.keys[:u], unique.table_ids[:u]
        given = (scores[utids.long()] if customized
                 else unique.counts[:u] if counted else None)
        want = verb.prepare_find_or_insert(ukeys, utids, given).commit()
        got_unique, got_pending = step.prepare_dedup_find_or_insert(
            keys, tids, freq, error=torch.zeros(1, dtype=torch.int64),
            table_scores=scores)
        got = got_pending.commit()
        what = f"call {call}"
        assert_same(got_unique.keys[:u], ukeys, f"{what} keys")
        assert_same(got.slots[:u], want.slots, f"{what} slots")
        assert_same(got.inserted[:u], want.inserted, f"{what} new keys")
        assert_same_tables(step.memory, verb.memory, what)
        assert step.size() == verb.size() and step.now == verb.now, what
        probe = torch.arange(-12, 60)
        for t in range(3):
            ids = torch.full_like(probe, t, dtype=torch.int16)
            assert_same(step.find(probe, ids), verb.find(probe, ids), f"{what} find")
    assert step.stats == verb.stats
    if ttl is not None:
        assert verb.stats.expired > 0, "some rows expired on a hit"


def test_abort_restores_expired_rows():
    """Aborting a step's call whose hits found expired rows gives them back their
    old scores (the key stays), and takes back the clock, size and totals."""
    from dynamicemb.table import ScoredHashTable
    from dynamicemb.types import DynamicEmbScoreStrategy as S
    table = ScoredHashTable(num_tables=2, capacity=64, bucket_capacity=16,
                            score_strategy=S.LRU_LFU, ttl=1)
    word = torch.zeros(1, dtype=torch.int64)
    rng = random.Random(5)
    first = batch(rng, 30, pool=40, tables=2)
    for keys, tids in (first, batch(rng, 10, pool=200, tables=2),
                       batch(rng, 10, pool=200, tables=2)):
        table.prepare_dedup_find_or_insert(keys, tids, error=word)[1].commit()
    before = [t.clone() for t in table.memory.meta]
    totals = table.outcome_totals().tensor.clone()
    clock, size = table.clock, table.size()
    _, pending = table.prepare_dedup_find_or_insert(*first, error=word)
    expired = table.outcome_totals().tensor[4] - totals[4]
    assert int(expired) > 0, "the call found expired rows"
    pending.abort()
    for name, x, y in zip(("keys", "scores", "tids", "digests", "occupied", "pinned"),
                          table.memory.meta, before):
        assert torch.equal(x, y), name
    assert torch.equal(table.outcome_totals().tensor, totals)
    assert table.clock == clock and table.size() == size
