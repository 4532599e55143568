"""The host's share of a training step: time at a tiny batch, syncs and launches.

At a tiny batch a step is nearly all host work (Python, dispatch, launches), so its
time is the overhead every batch pays before the kernels' own work. Two modules
train on the same batches, steps interleaved so that the machine's noise falls on both
alike: ``BatchedDynamicEmbeddingTables`` on the CPU backend, and FBGEMM's CPU TBE
(``SplitTableBatchedEmbeddingBagsCodegen``, the kernel behind TorchRec's fused CPU
tables) with the same optimizer.

It also counts, for one steady-state step of the CUDA backend's code (run on CPU
tensors, its kernels emulated: ``test/dynamicemb_testing/cuda_emulation.py``), the
host synchronizations (by site), the aten ops (and how many would launch a GPU kernel)
and the CuPy launches, with all rows on the device and with a device cache of 10% of
the ids; and the same for the CPU backend's own step (``sync_guard.counted_cpu``:
its host reads of tensor values, its aten ops and its calls of the extension). (The
emulated step's time is not reported: its kernels run on the CPU.)

Example::

    python benchmark/benchmark_step_overhead.py --lookups 64 --iterations 2000
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "test"))

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbOptimType,  # noqa: E402
                        DynamicEmbTableOptions)
from dynamicemb_testing.cuda_emulation import emulated_cuda  # noqa: E402
from dynamicemb_testing.sync_guard import SyncGuard, counted_cpu  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lookups", type=int, default=64, help="lookups per step (bags of 4)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--num-ids", type=int, default=100_000, help="ids drawn from [0, num-ids)")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--count-lookups", type=int, default=4096,
                   help="lookups of the step whose syncs and launches are counted")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of torch, FBGEMM and our kernels (a tiny batch "
                        "has no work to share: threads only add their wake-ups)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def dynamic_module(args, cache_rows=None):
    options = dict(dim=args.dim, max_capacity=2 * args.num_ids)
    if cache_rows is not None:
        options.update(local_hbm_for_values=cache_rows * args.dim * 4, caching=True)
    return BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(**options)],
                                         optimizer=DynamicEmbOptimType.EXACT_SGD,
                                         learning_rate=0.01)


def fbgemm_module(args):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(args.num_ids, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01)


def batches(args, lookups, count, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(0, lookups + 1, 4)
    return [(torch.randint(0, args.num_ids, (lookups,), generator=gen), offsets)
            for _ in range(count)]


def step(module, ids, offsets):
    module(ids, offsets).sum().backward()


def time_steps(args):
    """Median microseconds per step of each module, and each one's paired ratio to
    FBGEMM's (median of per-iteration ratios)."""
    data = batches(args, args.lookups, 64)
    modules = {"dynamicemb": dynamic_module(args), "fbgemm_cpu_tbe": fbgemm_module(args)}
    times = {name: [] for name in modules}
    for it in range(args.warmup + args.iterations):
        ids, offsets = data[it % len(data)]
        for name, module in modules.items():
            t0 = time.perf_counter()
            step(module, ids, offsets)
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    base = times["fbgemm_cpu_tbe"]
    return {name: {"median_us": round(statistics.median(xs) * 1e6, 1),
                   "ratio_to_fbgemm": round(statistics.median(a / b for a, b in zip(xs, base)), 3)}
            for name, xs in times.items()}


COUNTED = {"cuda_emulated": emulated_cuda, "cpu": counted_cpu}


def count_step(args, cache: bool, backend: str = "cuda_emulated"):
    """Syncs (by site), aten ops, aten launches and kernel launches (CuPy's, or the
    CPU extension's calls) of one steady step of ``backend`` (a key of ``COUNTED``)."""
    data = batches(args, args.count_lookups, 3, seed=1)
    with COUNTED[backend]() as kernels:
        module = dynamic_module(args, cache_rows=args.num_ids // 10 if cache else None)
        for ids, offsets in data:
            step(module, ids, offsets)
        kernels.launches.clear()
        with SyncGuard() as guard:
            kernels.guard = guard
            step(module, *data[0])
        kernels.guard = None
    sites = Counter(s.where.rsplit(" ", 1)[-1] for s in guard.syncs)
    return {"syncs": len(guard.syncs), "sync_sites": dict(sites), "aten_ops": len(guard.ops),
            "aten_launches": guard.launches(), "kernel_launches": sum(kernels.launches.values())}


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    result = {"args": vars(args), "host_time": time_steps(args),
              "counts": {backend: {"all_rows": count_step(args, False, backend),
                                   "cache_10pct": count_step(args, True, backend)}
                         for backend in COUNTED}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
