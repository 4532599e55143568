"""Throughput of the scored hash table beside the floor of a plain gather.

The HierarchicalKV method: the table is pre-filled to the target load factor
before timing; every timed batch holds keys already present (the steady state
of an embedding lookup), so the load stays where it was set. Per (load, dim):

- ``find``: hash lookup only; ``find+gather``: lookup, then ``index_select`` of
  the value rows; ``gather``: ``index_select`` of the same rows by known slot
  (the floor); ``ratio = (find+gather) / gather``. Gathers write into a
  preallocated buffer, so neither side times page faults of a fresh output;
- ``find_or_insert`` and ``insert_or_assign`` (hits: score updates, value writes).

Million keys per second from the median of ``--reps`` timed runs. Also reports
the bytes of metadata per slot beside the value rows. ``--device cuda`` runs the
same on a GPU (the CUDA backend; each timing ends with a device synchronize);
``--emulated`` runs the CUDA backend's code on the CPU (its kernels emulated, for
CI). Rows are printed and appended to ``--out``.jsonl as they come.

Example::

    python benchmark/benchmark_hash_table.py --capacity 1048576 --batch 65536
    python benchmark/benchmark_hash_table.py --device cuda --batch 1048576 --dims 8 64 128
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch

from _accelerator import accelerator
from _report import write_report

from dynamicemb import DynamicEmbScoreStrategy, ScoredHashTable

LOADS = (0.5, 0.75, 1.0)
DIMS = (8, 32, 64, 128)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(fns: Dict[str, Callable[[], object]], reps: int,
                        warmup: int = 3, device: torch.device = torch.device("cpu")
                        ) -> Dict[str, float]:
    """Median seconds of each function, timed round-robin (A, B, C, A, B, C, ...) so
    that the machine's noise falls on all of them alike and ratios stay fair."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def prefilled_table(capacity: int, dim: int, load: float, seed: int,
                    device: torch.device) -> ScoredHashTable:
    """A table of ``capacity`` slots filled to ``load`` with random int64 keys.

    Load 1.0 is reached by inserting past capacity: full buckets evict (LRU), so
    every slot ends up holding a key.
    """
    table = ScoredHashTable(
        capacity=capacity,
        value_dim=dim,
        max_load_factor=1.0,
        score_strategy=DynamicEmbScoreStrategy.LRU,
        device=device,
    )
    gen = torch.Generator(device).manual_seed(seed)
    target = int(load * table.capacity())
    while table.size() < target:
        missing = target - table.size()
        batch = max(missing, 1024) if load < 1.0 else max(missing * 2, 1024)
        keys = torch.randint(-(2**62), 2**62, (min(batch, missing + 65536, 1 << 22),),
                             generator=gen, device=device)
        if load < 1.0:
            keys = keys[:missing]
        table.insert_or_assign(keys, torch.randn(keys.numel(), dim, generator=gen, device=device))
    return table


def bench_one(capacity: int, dim: int, load: float, batch: int, reps: int,
              device: torch.device) -> Dict:
    table = prefilled_table(capacity, dim, load, seed=dim, device=device)
    present = table.export_batch().keys
    gen = torch.Generator(device).manual_seed(1)
    keys = present[torch.randint(0, present.numel(), (batch,), generator=gen, device=device)]
    slots = table.find(keys)
    assert bool((slots >= 0).all()), "benchmark keys must be present"
    values = table.values
    rows = torch.randn(batch, dim, generator=gen, device=device)

    # Both gathers write into one preallocated buffer: a fresh 32 MB output per call
    # would time page faults, not the gather, and inflate the floor.
    out = torch.empty(batch, dim, device=device)
    # The ratio's three timings interleave with each other only: the mutators below
    # write a lot and would change what the gathers find in the caches.
    t = interleaved_medians({
        "find": lambda: table.find(keys),
        "gather": lambda: torch.index_select(values, 0, slots, out=out),
        "find_gather": lambda: torch.index_select(values, 0, table.find(keys), out=out),
    }, reps, device=device)
    t.update(interleaved_medians({
        "find_or_insert": lambda: table.find_or_insert(keys),
        "insert_or_assign": lambda: table.insert_or_assign(keys, rows),
    }, reps, device=device))
    t_find, t_gather, t_find_gather = t["find"], t["gather"], t["find_gather"]
    t_foi, t_ioa = t["find_or_insert"], t["insert_or_assign"]
    mkeys = lambda t: batch / t / 1e6  # noqa: E731
    return {
        "load": load,
        "dim": dim,
        "actual_load": round(table.load_factor(), 4),
        "find_mkeys_s": mkeys(t_find),
        "find_gather_mkeys_s": mkeys(t_find_gather),
        "gather_mkeys_s": mkeys(t_gather),
        "find_or_insert_mkeys_s": mkeys(t_foi),
        "insert_or_assign_mkeys_s": mkeys(t_ioa),
        "ratio_find_gather_over_gather": t_find_gather / t_gather,
        "metadata_bytes_per_slot": table.memory_bytes()["metadata"] / table.capacity(),
        # Full buckets at high load evict even below capacity (more often in large
        # tables, whose fullest bucket is further above the mean).
        "evictions": table.stats.evictions,
    }


def markdown(rows: List[Dict]) -> str:
    head = (
        "| load | dim | find | find+gather | gather (floor) | ratio | find_or_insert "
        "| insert_or_assign | metadata B/slot |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['load']} | {r['dim']} | {r['find_mkeys_s']:.1f} | "
        f"{r['find_gather_mkeys_s']:.1f} | {r['gather_mkeys_s']:.1f} | "
        f"{r['ratio_find_gather_over_gather']:.2f}x | {r['find_or_insert_mkeys_s']:.1f} | "
        f"{r['insert_or_assign_mkeys_s']:.1f} | {r['metadata_bytes_per_slot']:.2f} |\n"
        for r in rows
    )
    return head + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=1 << 20)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--loads", type=float, nargs="+", default=list(LOADS))
    parser.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--emulated", action="store_true",
                        help="the CUDA backend's code on the CPU, its kernels emulated")
    parser.add_argument("--out", default="benchmark/out/hash_table")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    open(args.out + ".jsonl", "w").close()

    rows = []
    with (accelerator(emulated=True) if args.emulated else contextlib.nullcontext()) as acc:
        device = acc.device if args.emulated else torch.device(args.device)
        for load in args.loads:
            for dim in args.dims:
                rows.append(bench_one(args.capacity, dim, load, args.batch, args.reps, device))
                print(json.dumps(rows[-1]), flush=True)
                with open(args.out + ".jsonl", "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    meta = {
        "capacity": args.capacity,
        "batch": args.batch,
        "reps": args.reps,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else acc.name() if args.emulated else "cpu"),
        "unit": "million keys per second (median)",
    }
    table = markdown(rows)
    write_report(args.out, meta, rows, table)
    print(f"\n{json.dumps(meta)}\n\n{table}")


if __name__ == "__main__":
    main()
