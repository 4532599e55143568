"""The store below host memory on a Redis Cluster against one Redis server (issue 57).

Starts its own servers on loopback ports (one ``redis-server``; a cluster of 3
primaries with a replica each) and times, interleaved, medians:

- ``stores``: ``put`` and ``get`` of a batch of keys (rows of ``--width`` floats)
  through ``RedisStore`` (one server), ``RedisClusterStore`` waiting for a replica
  (``replicas_to_wait=1``, the default) and without waiting; rows/s;
- ``train``: the three-tier training step (host store with 10% of the touched rows,
  the rest below) over the cluster against one server.

    python benchmark/benchmark_redis_cluster.py --batch 65536 --width 128
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "test"))

import benchmark_external_storage as ext  # noqa: E402
from dynamicemb import RedisClusterStorage, RedisStorage  # noqa: E402
from dynamicemb_testing.redis_servers import RedisClusterServers, RedisServer  # noqa: E402


def part_stores(args, server, cluster) -> None:
    rows = (args.width, ext.float32_rows(args.width))
    stores = {
        "one server": RedisStorage(server.address).open("bench", *rows),
        "cluster, WAIT 1 replica": RedisClusterStorage(tuple(cluster.seeds), run="w").open(
            "bench", *rows),
        "cluster, no WAIT": RedisClusterStorage(tuple(cluster.seeds), run="n",
                                                replicas_to_wait=0).open("bench", *rows),
    }
    gen = torch.Generator().manual_seed(0)
    times = {(name, verb): [] for name in stores for verb in ("put", "get")}
    for r in range(args.repeats + 1):
        keys = torch.randint(-2**62, 2**62, (args.batch,), generator=gen)
        tids = torch.zeros(args.batch, dtype=torch.int64)
        rows = torch.randn(args.batch, args.width, generator=gen)
        scores = torch.arange(args.batch)
        for name, store in stores.items():
            t0 = time.perf_counter()
            store.put(keys, tids, rows, scores)
            t1 = time.perf_counter()
            found, _ = store.get(keys, tids)
            t2 = time.perf_counter()
            assert bool(found.all())
            if r:  # the first round warms up
                times[(name, "put")].append(t1 - t0)
                times[(name, "get")].append(t2 - t1)
    print(f"\n{args.batch} keys a call, rows of {args.width} floats; median of {args.repeats} "
          "interleaved rounds\n\n| store | put (rows/s) | get (rows/s) | put / one server's "
          "time | get / one server's time |\n|---|---|---|---|---|")
    base = {v: statistics.median(times[("one server", v)]) for v in ("put", "get")}
    for name in stores:
        put, get = (statistics.median(times[(name, v)]) for v in ("put", "get"))
        print(f"| {name} | {args.batch / put:,.0f} | {args.batch / get:,.0f} | "
              f"{put / base['put']:.2f} | {get / base['get']:.2f} |")
    for store in stores.values():
        store.close()


def part_train(args, server, cluster) -> None:
    warm, data = ext.batches(args, 5, seed=1), ext.batches(args, args.steps)
    touched = torch.cat([i for i, _ in warm + data]).unique().numel()
    host_rows = max(touched // 10, 128)
    layouts = {"all rows in host memory": ext.make(args),
               "10% in host, rest on one server": ext.make(
                   args, RedisStorage(server.address, run="train"), host_rows),
               "10% in host, rest on the cluster": ext.make(
                   args, RedisClusterStorage(tuple(cluster.seeds), run="train"), host_rows)}
    times = {name: [] for name in layouts}
    for ids, offsets in warm:
        for m in layouts.values():
            ext.step(m, ids, offsets)
    for ids, offsets in data:
        for name, m in layouts.items():
            times[name].append(ext.step(m, ids, offsets))
    base = statistics.median(times["all rows in host memory"])
    one = statistics.median(times["10% in host, rest on one server"])
    print(f"\n{args.ids} ids a step, dim {args.dim}, row-wise Adagrad, {touched} rows touched, "
          f"host budget {host_rows} rows; median of {args.steps} interleaved steps\n\n"
          "| layout | step (ms) | / all in host | / one server |\n|---|---|---|---|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.2f} | {med / one:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="+", choices=["stores", "train"], default=["stores", "train"])
    p.add_argument("--batch", type=int, default=65536, help="keys per store call")
    p.add_argument("--width", type=int, default=128, help="floats per stored row")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--steps", type=int, default=30, help="timed training steps")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--ids", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-cluster-")
    server = cluster = None
    try:
        os.makedirs(os.path.join(tmp, "one"))
        server = RedisServer(os.path.join(tmp, "one"))
        cluster = RedisClusterServers(os.path.join(tmp, "cluster"))
        if "stores" in args.part:
            part_stores(args, server, cluster)
        if "train" in args.part:
            part_train(args, server, cluster)
    finally:
        for s in (server, cluster):
            if s is not None:
                s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
