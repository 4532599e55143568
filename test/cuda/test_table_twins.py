"""The CUDA hash table against the CPU one, operation by operation.

Inserting passes walk each bucket's keys in input order on both backends, so twin
tables fed the same calls must hold the same bytes: every slot's key, score,
table id and digest, the occupancy bits, the value rows, and every result
(slots, inserted flags, victims, counts) must be equal, through growth mid-call,
eviction with pinned slots, failed inserts, undo, erase and export.

The CUDA twin runs on a GPU where there is one, and everywhere on the kernels' own
source run on the CPU (``dynamicemb_testing.simt``, device ``cuda-simt``).
"""

import contextlib
import random

import pytest
import torch

from dynamicemb import DynamicEmbCheckMode, DynamicEmbScoreStrategy, ScoredHashTable
from dynamicemb.table import hash_keys
from dynamicemb_testing.cuda_emulation import emulated_cuda, real_cpu
from dynamicemb_testing.devices import SIMT

STRATEGIES = list(DynamicEmbScoreStrategy.__members__.values())
CUDA = torch.device("cuda")  # the CUDA twin's device: set per test by the fixture


@pytest.fixture(autouse=True, params=[pytest.param("cuda", marks=pytest.mark.cuda), SIMT])
def cuda_twin(request):
    """The CUDA twin's backend: a GPU, or the kernels' source on the CPU."""
    global CUDA
    if request.param == "cuda":
        CUDA = torch.device("cuda")
        yield
        return
    from dynamicemb_testing.simt import SimtCudaKernels  # noqa: PLC0415

    CUDA = torch.device("cpu")
    with emulated_cuda(SimtCudaKernels()):
        yield
    CUDA = torch.device("cuda")


def twins(**kw):
    """A CPU table and its CUDA twin (under the emulation, the CPU one keeps the CPU
    backend)."""
    with real_cpu() if CUDA.type == "cpu" else contextlib.nullcontext():
        cpu = ScoredHashTable(**kw)
    return cpu, ScoredHashTable(device=CUDA, **kw)


def on_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple):
        return type(x)(*[on_cpu(v) for v in x]) if hasattr(x, "_fields") else tuple(
            on_cpu(v) for v in x)
    return x


def assert_same(a, b, what):
    a, b = on_cpu(a), on_cpu(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.shape} vs {b.shape}"
        assert torch.equal(a, b), f"{what} differ:\n{a}\n{b}"
    elif isinstance(a, tuple):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a} vs {b}"


def assert_same_state(cpu: ScoredHashTable, gpu: ScoredHashTable, step: str):
    assert cpu.size() == gpu.size() and cpu.capacity() == gpu.capacity(), step
    assert cpu.clock == gpu.clock and cpu.generation == gpu.generation, step
    assert cpu.stats == gpu.stats, step
    for name, x, y in zip(("keys", "scores", "tids", "digests", "occupied", "pinned"),
                          cpu._memory.meta, gpu._memory.meta):
        assert_same(x, y, f"{step}: {name}")
    assert_same(cpu.values, gpu.values, f"{step}: values")


def keys_from(rng: random.Random, pool, n):
    return torch.tensor([rng.choice(pool) for _ in range(n)], dtype=torch.int64)


def both(cpu, gpu, verb, *args, **kw):
    """Calls verb on both twins (CUDA gets its tensors moved) and checks results."""
    def to(x):
        return x.to(CUDA) if isinstance(x, torch.Tensor) else x
    want = getattr(cpu, verb)(*args, **kw)
    got = getattr(gpu, verb)(*[to(a) for a in args], **{k: to(v) for k, v in kw.items()})
    assert_same(want, got, verb)
    return want


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("bucket_capacity", [16, 128])
@pytest.mark.parametrize("grows", [False, True])
def test_random_calls_match_cpu(strategy, bucket_capacity, grows):
    rng = random.Random(f"{strategy.name}{bucket_capacity}{grows}")
    capacity = 4 * bucket_capacity
    cpu, gpu = twins(num_tables=3, capacity=capacity, bucket_capacity=bucket_capacity,
                     score_strategy=strategy, max_capacity=8 * capacity if grows else capacity,
                     max_load_factor=0.75, value_dim=3)
    pool = [rng.randrange(-2**63, 2**63) for _ in range(6 * capacity)] + [0, -1, 2**63 - 1]
    customized = strategy == DynamicEmbScoreStrategy.CUSTOMIZED
    for step in range(30):
        n = rng.choice([0, 1, 7, 100, 3 * bucket_capacity])
        keys = keys_from(rng, pool, n)
        tids = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(step))
        scores = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(step))
        scores = scores if customized or strategy == DynamicEmbScoreStrategy.LFU else None
        rows = torch.randn(n, 3, generator=torch.Generator().manual_seed(step))
        verb = rng.choice(["find_or_insert", "insert_or_assign", "insert_and_evict", "erase",
                           "find", "dedup"])
        if strategy == DynamicEmbScoreStrategy.STEP:
            cpu.set_step(step)
            gpu.set_step(step)
        if verb == "find_or_insert":
            both(cpu, gpu, verb, keys, tids, scores if customized else None)
        elif verb in ("insert_or_assign", "insert_and_evict"):
            both(cpu, gpu, verb, keys, rows, tids, scores if customized else None)
        elif verb == "erase":
            both(cpu, gpu, verb, keys, tids)
        elif verb == "find":
            both(cpu, gpu, verb, keys, tids)
        elif not customized:
            freq = torch.randint(1, 4, (n,), generator=torch.Generator().manual_seed(step))
            want = cpu.prepare_dedup_find_or_insert(keys, tids, freq)
            got = gpu.prepare_dedup_find_or_insert(keys.to(CUDA), tids.to(CUDA), freq.to(CUDA))
            assert_same(want[0], got[0], "dedup")
            assert_same(want[1].slots, got[1].slots, "dedup slots")
            if rng.random() < 0.3:
                want[1].abort()
                got[1].abort()
            else:
                assert_same(want[1].commit(), got[1].commit(), "dedup commit")
        assert_same_state(cpu, gpu, f"step {step} ({verb}, {n} keys)")
    assert_same(cpu.export_batch(), gpu.export_batch(), "export")
    assert_same(cpu.export_batch(5, 40, min_score=3), gpu.export_batch(5, 40, min_score=3),
                "export range")


def test_error_mode_undoes_like_cpu():
    """A call that cannot land every key is undone on both (ERROR mode)."""
    cpu, gpu = twins(capacity=16, bucket_capacity=16, max_capacity=16, value_dim=2,
                     score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                     check_mode=DynamicEmbCheckMode.ERROR)
    both(cpu, gpu, "find_or_insert", torch.arange(10))
    for table, dev in ((cpu, "cpu"), (gpu, CUDA)):
        with pytest.raises(RuntimeError, match="undone"):
            table.find_or_insert(torch.arange(5, 30, device=dev))
    assert_same_state(cpu, gpu, "after the undone call")


def test_hash_keys_match_cpu():
    keys = torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 123456789], dtype=torch.int64)
    tids = torch.tensor([0, 1, 2, 3, 32766, 7], dtype=torch.int64)
    assert_same(hash_keys(keys, tids), hash_keys(keys.to(CUDA), tids.to(CUDA)), "hashes")


def test_large_batch_matches_cpu():
    """A million keys (16K on the CPU runtime) into a table that grows twice and then
    evicts."""
    bits = 19 if CUDA.type == "cuda" else 14
    cpu, gpu = twins(capacity=1 << (bits - 1), max_capacity=1 << (bits + 1), value_dim=0,
                     max_load_factor=0.9)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        keys = torch.randint(-2**62, 2**62, (1 << bits,), generator=gen)
        keys[::3] = keys[:(keys.numel() + 2) // 3]  # repeats
        both(cpu, gpu, "find_or_insert", keys)
        assert_same_state(cpu, gpu, f"step {step}")
    both(cpu, gpu, "find", keys)


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.STEP,
                                      DynamicEmbScoreStrategy.LRU_LFU], ids=lambda s: s.name)
def test_ttl_expiry_and_sweeps_match_cpu(strategy):
    """Expired hits (fresh rows), finds that skip expired rows and the sweep kernel
    (a thread per slot on CUDA, a loop over buckets on CPU) leave the same bytes."""
    rng = random.Random(strategy.name)
    cpu, gpu = twins(num_tables=2, capacity=256, bucket_capacity=16, score_strategy=strategy,
                     max_capacity=1024, value_dim=2, ttl=3)
    pool = [rng.randrange(-2**63, 2**63) for _ in range(600)]
    for step in range(1, 40):
        cpu.set_step(step)
        gpu.set_step(step)
        n = rng.choice([0, 5, 60, 200])
        keys = keys_from(rng, pool[:200] if step % 10 < 5 else pool, n)
        tids = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(step))
        verb = rng.choice(["find_or_insert", "find_or_insert", "find", "expire"])
        if verb == "expire":
            both(cpu, gpu, "expire")
        else:
            both(cpu, gpu, verb, keys, tids)
        assert_same_state(cpu, gpu, f"step {step} {verb}")
    assert cpu.stats.expired > 0
