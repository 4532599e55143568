"""The CPU runtime of the CUDA kernels (``csrc/simt``, ``dynamicemb_testing.simt``).

First the runtime against small kernels written here: warp collectives give what a
GPU gives, atomics count exactly, dynamic shared memory is a block's, and each misuse
that a GPU leaves undefined fails the launch by name (a collective a lane skips or
reaches at another call site, a shuffle from outside the mask, an argument of the
wrong type, undefined behaviour). A missing ``__syncwarp`` shows as a result that
depends on the lanes' order.

Then deliberately broken copies of ``csrc/cuda``: each break is caught by the kernels'
own source run here, where the CPU-verb emulation (``EmulatedCudaKernels``), which never
runs the kernels, passes the same scenario.
"""

import os

import numpy as np
import pytest
import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
from dynamicemb.ops.cuda import cuda_source_root
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb_testing.cuda_emulation import EmulatedCudaKernels, emulated_cuda
from dynamicemb_testing.simt import KernelFault, SimtCudaKernels, build, build_flags, launch, load

_TOY = r"""
extern "C" __global__ void t_shfl(const int* in, int* out, int delta) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = __shfl_sync(0xFFFFFFFFu, in[i], (threadIdx.x + delta) & 31);
}
extern "C" __global__ void t_ballot(const int* in, unsigned* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = __ballot_sync(0xFFFFFFFFu, in[i] > 0);
}
extern "C" __global__ void t_xor_sum(const int* in, int* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  int v = in[i];
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, d);
  out[i] = v;
}
extern "C" __global__ void t_count(unsigned long long* counter, int* set) {
  atomicAdd(counter, 1ull);
  atomicMin(set, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
}
extern "C" __global__ void t_divergent(unsigned* out) {
  if (threadIdx.x & 1) out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
}
extern "C" __global__ void t_two_sites(int* out) {
  int x;
  if ((threadIdx.x & 31) < 16) {
    x = __shfl_sync(0xFFFFFFFFu, 1, 0);
  } else {
    x = __shfl_sync(0xFFFFFFFFu, 2, 0);
  }
  out[threadIdx.x] = x;
}
extern "C" __global__ void t_outside_mask(int* out) {
  if ((threadIdx.x & 31) < 16) out[threadIdx.x] = __shfl_sync(0x0000FFFFu, 1, 20);
}
extern "C" __global__ void t_exchange(int* buf, int* out, bool sync) {
  const int lane = threadIdx.x & 31;
  buf[lane] = lane + 100;
  if (sync) __syncwarp();
  out[lane] = buf[(lane + 1) & 31];
}
extern "C" __global__ void t_shared(float* out) {
  extern __shared__ float s[];
  s[threadIdx.x] = static_cast<float>(blockIdx.x * 1000 + threadIdx.x);
  __syncwarp();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x ^ 1];
}
extern "C" __global__ void t_shift(int* out, int shift) { out[threadIdx.x] = 1 << shift; }
"""


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return load(build(str(tmp_path_factory.mktemp("toy")), sources={"toy.cu": _TOY}))


def p(a: np.ndarray) -> np.uint64:
    return np.uint64(a.ctypes.data)


def run(lib, name, grid, block, args, order="shuffled", shared=0, seed=1):
    launch(lib, name, grid, block, shared, args, {"forward": 0, "reverse": 1,
                                                  "shuffled": 2}[order], seed)


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled"])
def test_collectives_give_what_a_gpu_gives(toy, order):
    rng = np.random.default_rng(0)
    x = rng.integers(-50, 50, 128).astype(np.int32)
    out = np.zeros(128, np.int32)
    run(toy, "t_shfl", 2, 64, [p(x), p(out), np.int32(5)], order)
    lane = np.arange(128) % 32
    assert (out == x[np.arange(128) - lane + (lane + 5) % 32]).all()
    bits = np.zeros(128, np.uint32)
    run(toy, "t_ballot", 2, 64, [p(x), p(bits)], order)
    for w in range(4):
        want = sum(1 << b for b in range(32) if x[32 * w + b] > 0)
        assert (bits[32 * w:32 * w + 32] == want).all()
    run(toy, "t_xor_sum", 2, 64, [p(x), p(out)], order)
    assert (out == np.repeat(x.reshape(4, 32).sum(1), 32)).all()


def test_atomics_and_shared_memory(toy):
    counter, first = np.zeros(1, np.uint64), np.full(1, 1 << 30, np.int32)
    run(toy, "t_count", 3, 96, [p(counter), p(first)])
    assert counter[0] == 288 and first[0] == 0
    out = np.zeros(128, np.float32)
    run(toy, "t_shared", 2, 64, [p(out)], shared=64 * 4)
    i = np.arange(128)
    assert (out == (i // 64) * 1000 + ((i % 64) ^ 1)).all()
    with pytest.raises(KernelFault, match="dynamic shared memory"):
        run(toy, "t_shared", 1, 64, [p(out)], shared=1 << 20)


def test_a_collective_a_lane_skips_or_reaches_elsewhere_fails(toy):
    out = np.zeros(64, np.int32)
    with pytest.raises(KernelFault, match="has exited without reaching it"):
        run(toy, "t_divergent", 1, 32, [p(out)])
    with pytest.raises(KernelFault, match="different collectives"):
        run(toy, "t_two_sites", 1, 32, [p(out)])
    with pytest.raises(KernelFault, match="outside the mask"):
        run(toy, "t_outside_mask", 1, 32, [p(out)])


def test_a_missing_syncwarp_shows_as_an_order_dependent_result(toy):
    results = {}
    for sync in (False, True):
        for order in ("forward", "reverse"):
            buf, out = np.zeros(32, np.int32), np.zeros(32, np.int32)
            run(toy, "t_exchange", 1, 32, [p(buf), p(out), np.bool_(sync)], order)
            results[sync, order] = out.copy()
    assert (results[True, "forward"] == results[True, "reverse"]).all()
    assert (results[True, "forward"] == (np.arange(32) + 1) % 32 + 100).all()
    assert not (results[False, "forward"] == results[False, "reverse"]).all()


def test_mistyped_arguments_and_undefined_behaviour_fail_the_launch(toy):
    out = np.zeros(32, np.int32)
    with pytest.raises(KernelFault, match="argument 1 is i64"):
        run(toy, "t_shift", 1, 32, [p(out), np.int64(3)])
    with pytest.raises(KernelFault, match="takes 2 arguments, was given 1"):
        run(toy, "t_shift", 1, 32, [p(out)])
    with pytest.raises(KernelFault, match="a Python int"):
        run(toy, "t_shift", 1, 32, [p(out), 3])
    run(toy, "t_shift", 1, 32, [p(out), np.int32(3)])
    assert (out == 8).all()
    if "-fsanitize=address" in build_flags():  # a report ends the process there
        return
    with pytest.raises(KernelFault, match="undefined behaviour.*shift"):
        run(toy, "t_shift", 1, 32, [p(out), np.int32(40)])


# ------------------------------------------------------------ broken kernels
def _source(name: str) -> str:
    with open(os.path.join(cuda_source_root(), "cuda", name)) as f:
        return f.read()


def broken(tmp_path, name: str, old: str, new: str):
    """csrc/cuda's kernels with ``old`` replaced by ``new`` in file ``name``."""
    sources = {n: _source(n) for n in os.listdir(os.path.join(cuda_source_root(), "cuda"))
               if n.endswith(".cu")}
    text = sources.get(name, _source(name))
    assert text.count(old) == 1, f"{old!r} is not once in {name}"
    sources[name] = text.replace(old, new)
    return load(build(str(tmp_path), sources=sources))


def trained(kernels, optimizer, dim=40):
    """Three training steps of a module with repeated ids (so the step's dedup pads)
    on the CPU backend (kernels None) or under the emulation with ``kernels``: the
    outputs and the stored rows by key."""
    torch.manual_seed(0)

    def steps():
        module = BatchedDynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=dim, max_capacity=1024, bucket_capacity=16)],
            optimizer=optimizer, learning_rate=0.1)
        outs = []
        for _ in range(3):
            ids = torch.randint(1, 41, (48,))  # no key 0: the padding's key
            out = module(ids, torch.arange(0, 49, 4))
            (out * torch.randn(out.shape)).sum().backward()
            outs.append(out.detach().clone())
        rows = module.export_keys_values("t0")
        order = torch.argsort(rows.keys)
        return outs, rows.keys[order], rows.embeddings[order]

    if kernels is None:
        return steps()
    with emulated_cuda(kernels):
        return steps()


def same(a, b) -> bool:
    outs_a, keys_a, rows_a = a
    outs_b, keys_b, rows_b = b
    return (all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))
            and torch.equal(keys_a, keys_b) and torch.equal(rows_a, rows_b))


ROWWISE = DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD


def test_the_real_kernels_train_like_the_cpu_backend():
    want = trained(None, ROWWISE)
    for order in ("forward", "reverse", "shuffled"):
        assert same(trained(SimtCudaKernels(order), ROWWISE), want), order
    assert same(trained(EmulatedCudaKernels(), ROWWISE), want)


def test_a_removed_syncwarp_is_caught(tmp_path):
    """Without the __syncwarp of the row-wise update, lane 0 writes the row's
    accumulator before the other lanes read it: they scale their columns by the new
    one and the rows differ (the verbs' emulation passes)."""
    lib = broken(tmp_path, "embedding.cu",
                 "  __syncwarp();  // every lane read the accumulator before lane 0 writes it\n",
                 "")
    want = trained(None, ROWWISE)
    assert same(trained(EmulatedCudaKernels(), ROWWISE), want)
    assert not same(trained(SimtCudaKernels("forward", lib=lib), ROWWISE), want)


def test_a_divergent_ballot_is_caught(tmp_path):
    """A probe whose ballot only lanes holding digests reach (buckets of 16 slots:
    lanes 0-3) fails the launch by name."""
    lib = broken(tmp_path, "common.cuh",
                 "    const unsigned hit = __ballot_sync(kFullMask, found >= 0);\n"
                 "    if (hit) return __shfl_sync(kFullMask, found, __ffs(hit) - 1);",
                 "    if (j0 < v.bc) {\n"
                 "      const unsigned hit = __ballot_sync(kFullMask, found >= 0);\n"
                 "      if (hit) return __shfl_sync(kFullMask, found, __ffs(hit) - 1);\n"
                 "    }")
    assert same(trained(EmulatedCudaKernels(), ROWWISE), trained(None, ROWWISE))
    with pytest.raises(KernelFault, match="__ballot_sync at .*common.cuh"):
        trained(SimtCudaKernels(lib=lib), ROWWISE)


def test_a_dropped_padding_check_is_caught(tmp_path):
    """Without the check, the padding positions of the step's dedup (bucket
    kNoBucket) start a run of that bucket: its bits are read far past the table, an
    illegal address on a GPU, a fault of the launch here (not of the process)."""
    lib = broken(tmp_path, "hash_table.cu", "  if (b == kNoBucket) {", "  if (false) {")
    want = trained(None, DynamicEmbOptimType.EXACT_SGD)
    assert same(trained(EmulatedCudaKernels(), DynamicEmbOptimType.EXACT_SGD), want)
    with pytest.raises(KernelFault, match="demb_upsert: illegal memory access"):
        trained(SimtCudaKernels(lib=lib), DynamicEmbOptimType.EXACT_SGD)


# ------------------------------------------------------------ kernel contracts
def test_keys_given_a_stale_bucket_fail_and_leave_the_table_whole():
    """demb_upsert checks each key's bucket against its own hash: a caller passing
    stale buckets (all 0 here) gets those keys failed (slot -1, FAILED), and the
    occupancy bits still count the stored keys; the keys of bucket 0 land."""
    from dynamicemb.table import ScoredHashTable, hash_keys  # noqa: PLC0415

    with emulated_cuda(SimtCudaKernels()):
        table = ScoredHashTable(capacity=64, bucket_capacity=16, max_capacity=64)
        keys = torch.arange(1, 25)
        tids = torch.zeros(24, dtype=torch.int16)
        real = torch.bitwise_and(hash_keys(keys, tids.long()), 3).int()
        outcomes = torch.zeros(5, dtype=torch.int64)
        size = torch.zeros(1, dtype=torch.int64)
        slots, status = table._ops.kernels.upsert(
            table._memory.meta, 16, keys, tids, None, 0, False, False,
            torch.zeros(24, dtype=torch.int32), outcomes, size)[:2]
        home = real == 0
        assert 0 < int(home.sum()) < 24
        assert (status[~home] == 3).all() and (slots[~home] == -1).all()
        assert (status[home] == 1).all() and (slots[home] // 16 == 0).all()
        occupied = table._memory.meta[4]
        bits = sum(bin(int(w) & (2**64 - 1)).count("1") for w in occupied.flatten().tolist())
        assert bits == int(home.sum()) == int(size[0]) == int(outcomes[1])
        assert int(outcomes[3]) == int((~home).sum())
