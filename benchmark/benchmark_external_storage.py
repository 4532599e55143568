"""The external tier: store overhead, training speed, host memory (issue 26).

Three parts, each in one run with the things it compares interleaved (medians):

- ``stores``: our batched ``get``/``put`` (tensors in, tensors out: packing, the
  found mask, unpacking) against the store's own raw batched calls on the same keys
  with the bytes already packed (RocksDB multi-get and ``WriteBatch``; one Redis
  pipeline of ``MGET``/``MSET``), rows/s and the ratio;
- ``train``: training steps/s with the host store holding 10% of the touched rows and
  the rest in RocksDB (and over Redis on loopback), against every row in host memory;
- ``memory``: host RSS of a table of N rows with every row in host memory against a
  host budget with the rest in RocksDB (each in a fresh subprocess).

Redis parts start their own ``redis-server`` on a loopback port (skipped without one).

    python benchmark/benchmark_external_storage.py                  # all three parts
    python benchmark/benchmark_external_storage.py --part train --steps 20
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs,
                        DynamicEmbOptimType, DynamicEmbTableOptions, RedisStorage, RocksDBStorage)
from dynamicemb.ops.interface import RowFormat


def float32_rows(width: int) -> str:
    """The format tag of rows of ``width`` float32 words (what a raw store benchmark puts)."""
    return RowFormat(torch.float32, width, 0).tag


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", nargs="+", choices=["stores", "train", "memory", "all"],
                   default=["all"])
    p.add_argument("--batch", type=int, default=16384, help="keys per store call")
    p.add_argument("--width", type=int, default=64, help="floats per stored row")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--steps", type=int, default=60, help="timed training steps")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--ids", type=int, default=1024,
                   help="ids per training batch (a batch's keys must fit in the host budget)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the memory part")
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OpenMP threads (see RESULTS.md: 2 threads on a loaded 2-core VM "
                        "wait a scheduler tick per parallel region after a store call)")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------- a redis-server
class Redis:
    """A ``redis-server`` of our own on 127.0.0.1 (no persistence)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start in 5 s")

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_or_none():
    if shutil.which("redis-server") is None:
        print("redis-server not installed: Redis parts skipped")
        return None
    return Redis()


# ---------------------------------------------------------------------- stores
def raw_calls(store):
    """The store's own batched calls over pre-packed bytes: (get, put)."""
    if hasattr(store, "_db"):  # RocksDB
        import rocksdict
        db = store._db

        def put(keys, values):
            batch = rocksdict.WriteBatch(raw_mode=True)
            for k, v in zip(keys, values):
                batch.put(k, v)
            db.write(batch)
        return db.get, put
    client = store._client

    def get(keys):
        pipe = client.pipeline(transaction=False)
        pipe.mget(keys)
        return pipe.execute()[0]

    def put(keys, values):
        pipe = client.pipeline(transaction=False)
        pipe.mset(dict(zip(keys, values)))
        pipe.execute()
    return get, put


def bench_store(name, store, args):
    n = args.batch
    gen = torch.Generator().manual_seed(0)
    times = {k: [] for k in ("ours get", "raw get", "ours put", "raw put")}
    raw_get, raw_put = raw_calls(store)
    for r in range(args.repeats + 2):
        keys = torch.randint(-2**62, 2**62, (n,), generator=gen).unique()
        tids = torch.zeros_like(keys)
        rows = torch.randn(keys.numel(), args.width, generator=gen)
        scores = torch.arange(keys.numel())
        packed_k, packed_v = store._pack_keys(keys, tids), store._pack_values(rows, scores)
        # half the probed keys are stored: misses cost too
        probe = torch.cat([keys[: n // 2], keys[: n // 2] + 1])
        packed_probe = store._pack_keys(probe, torch.zeros_like(probe))
        calls = {
            "ours put": lambda: store.put(keys, tids, rows, scores),
            "raw put": lambda: raw_put(packed_k, packed_v),
            "ours get": lambda: store.get(probe, torch.zeros_like(probe))[0],
            "raw get": lambda: raw_get(packed_probe),
        }
        order = list(calls) if r % 2 else ["raw put", "ours put", "raw get", "ours get"]
        took = {}
        for call in order:  # the order alternates: neither side always goes first
            t0 = time.perf_counter()
            result = calls[call]()
            took[call] = time.perf_counter() - t0
            if call == "ours get":
                assert int(result.sum()) == n // 2
            if call == "raw get":
                assert sum(v is not None for v in result) == n // 2
        if r >= 2:
            for call, t in took.items():
                times[call].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    for verb in ("get", "put"):
        ours, raw = med[f"ours {verb}"], med[f"raw {verb}"]
        paired = statistics.median(a / b for a, b in zip(times[f"ours {verb}"], times[f"raw {verb}"]))
        print(f"| {name} | {verb} | {n / ours / 1e6:.3f} | {n / raw / 1e6:.3f} | "
              f"{ours / raw:.2f} | {paired:.2f} |")


def part_stores(args):
    print(f"\n{args.batch} keys per call, rows of {args.width} floats, median of "
          f"{args.repeats}; raw = the store's own batched call on pre-packed bytes\n")
    print("| store | verb | ours (M rows/s) | raw (M rows/s) | ours / raw (medians) | "
          "paired ratio |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-rocks-") as d:
        store = RocksDBStorage(d).open("bench", args.width, float32_rows(args.width))
        bench_store("RocksDB", store, args)
        store.close()
    server = redis_or_none()
    if server is not None:
        try:
            store = RedisStorage(server.address).open("bench", args.width,
                                                      float32_rows(args.width))
            bench_store("Redis (loopback)", store, args)
            store.close()
        finally:
            server.stop()


# ---------------------------------------------------------------------- training
def batches(args, steps, seed=0):
    """Power-law ids (alpha 1.05) over 2M keys, 4 ids per bag."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        u = torch.rand(args.ids, generator=gen, dtype=torch.float64)
        ids = (((2e6 ** -0.05 - 1) * u + 1) ** (1 / -0.05)).long() * 7919
        out.append((ids, torch.arange(0, args.ids + 1, 4)))
    return out


def make(args, external=None, host_rows=None):
    opt = DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD
    row_bytes = (args.dim + 1) * 4
    options = DynamicEmbTableOptions(
        dim=args.dim, max_capacity=1 << 20, score_strategy="lru",
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.01),
        external_storage=external,
        local_host_for_values=None if host_rows is None else host_rows * row_bytes)
    return BatchedDynamicEmbeddingTables([options], table_names=["t"], optimizer=opt,
                                         learning_rate=0.01)


def step(module, ids, offsets):
    t0 = time.perf_counter()
    out = module(ids, offsets)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - t0


def part_train(args):
    warm, data = batches(args, 5, seed=1), batches(args, args.steps)
    touched = torch.cat([i for i, _ in warm + data]).unique().numel()
    host_rows = max(touched // 10, 128)  # at least one bucket
    tmp = tempfile.mkdtemp(prefix="bench-ext-")
    server = redis_or_none()
    name_rocks = "10% in host, rest in RocksDB"
    layouts = {"all rows in host memory": make(args),
               name_rocks: make(args, os.path.join(tmp, "db"), host_rows)}
    if server is not None:
        layouts["10% in host, rest in Redis (loopback)"] = make(
            args, RedisStorage(server.address), host_rows)
    try:
        times = {name: [] for name in layouts}
        for ids, offsets in warm:
            for m in layouts.values():
                step(m, ids, offsets)
        for ids, offsets in data:  # interleaved: each step on every layout in turn
            for name, m in layouts.items():
                times[name].append(step(m, ids, offsets))
        base = statistics.median(times["all rows in host memory"])
        print(f"\n{args.ids} ids per step (power law over 2M keys, alpha 1.05), dim "
              f"{args.dim}, row-wise Adagrad, {touched} rows touched, host budget {host_rows} "
              f"rows (the host store: {layouts[name_rocks]._groups[0].table.max_capacity()} "
              f"rows, power-of-two buckets); median of {args.steps} interleaved steps\n")
        print("| layout | step (ms) | steps/s | time / all-in-host | rows down / up |\n"
              "|---|---|---|---|---|")
        for name, t in times.items():
            med = statistics.median(t)
            m = layouts[name].cache_metrics()["t"]
            print(f"| {name} | {med * 1e3:.3f} | {1 / med:.1f} | {med / base:.2f} | "
                  f"{m.external_writes} / {m.external_reads} |")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------- memory
def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_child(args, layout):
    """Fills one table of ``args.rows`` rows and prints the RSS it added."""
    tmp = tempfile.mkdtemp(prefix="bench-mem-")
    before = rss_bytes()
    dim, host_rows = args.dim, args.rows // 16
    external = None if layout == "host" else os.path.join(tmp, "db")
    options = DynamicEmbTableOptions(
        dim=dim, max_capacity=1 << (2 * args.rows - 1).bit_length(), init_capacity=1 << 14,
        external_storage=external,
        local_host_for_values=None if external is None else host_rows * dim * 4)
    module = BatchedDynamicEmbeddingTables([options], table_names=["t"],
                                           optimizer=DynamicEmbOptimType.EXACT_SGD)
    chunk = 1 << 16
    for start in range(0, args.rows, chunk):
        n = min(chunk, args.rows - start)
        keys = torch.arange(start, start + n) * 2654435761 + 12345
        module.import_keys_values("t", keys, torch.randn(n, dim))
    module.flush()
    assert module.table_size("t") == args.rows
    print(rss_bytes() - before)
    shutil.rmtree(tmp, ignore_errors=True)


def part_memory(args):
    print(f"\nOne table of {args.rows} rows, dim {args.dim}, SGD ({args.dim * 4} B a row); "
          f"host budget {args.rows // 16} rows (1/16); RSS added by building and filling it, "
          "each in a fresh process\n")
    print("| layout | host RSS added (MiB) | rows in the host store |\n|---|---|---|")
    for layout, label in (("host", "all rows in host memory"), ("rocksdb", "budget + RocksDB")):
        out = subprocess.run([sys.executable, __file__, "--memory-child", layout,
                              "--rows", str(args.rows), "--dim", str(args.dim)],
                             capture_output=True, text=True, check=True)
        rows = args.rows if layout == "host" else args.rows // 16
        print(f"| {label} | {int(out.stdout.split()[-1]) / 2**20:.0f} | {rows} |")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        return memory_child(args, args.memory_child)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    for part in ("stores", "train", "memory"):
        if part in args.part or "all" in args.part:
            globals()[f"part_{part}"](args)


if __name__ == "__main__":
    main()
