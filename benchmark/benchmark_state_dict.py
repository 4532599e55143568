"""The three checkpoint paths of a dynamic table side by side: rows/s and peak memory.

One process (a 1-rank gloo group), one DMP-sharded EmbeddingCollection holding one
dynamic table of ``--rows`` rows (dim ``--dim``, Adam states). Round robin, ``--reps``
times: ``torch.distributed.checkpoint`` save and load of ``{"model":
model.state_dict()}`` (the dynamic_state entry), ``DynamicEmbDump`` and
``DynamicEmbLoad``, and the module's own ``state_dict`` through ``torch.save`` /
``torch.load(weights_only=True)`` + ``load_state_dict``. Peak memory is the rise of
the process's peak RSS over the RSS before the call (``/proc/self/clear_refs``).

    PYTHONPATH=. python benchmark/benchmark_state_dict.py --rows 1000000 --dim 32
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan

from dynamicemb import DynamicEmbDump, DynamicEmbLoad, DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingCollectionSharder, get_dynamic_tables


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return parser.parse_args()


def build(rows: int, dim: int):
    """A 1-rank DMP model whose dynamic table "t" holds ``rows`` random rows."""
    capacity = 1 << (2 * rows - 1).bit_length()
    ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name="t", num_embeddings=capacity, embedding_dim=dim, feature_names=["f"])],
        device=torch.device("meta"))
    sharder = DynamicEmbeddingCollectionSharder(fused_params={"optimizer": "adam"})
    plan = construct_module_sharding_plan(ec, {"t": table_wise(rank=0, compute_kernel="fused")},
                                          sharder=sharder, local_size=1, world_size=1,
                                          device_type="cpu")
    plan["t"] = to_dynamic_sharding(plan["t"], DynamicEmbTableOptions(dim=dim, max_capacity=capacity))
    dmp = DistributedModelParallel(ec, plan=ShardingPlan({"": plan}), sharders=[sharder],
                                   device=torch.device("cpu"))
    module = get_dynamic_tables(dmp)["t"]
    g = torch.Generator().manual_seed(0)
    for start in range(0, rows, 1 << 18):
        n = min(1 << 18, rows - start)
        keys = torch.arange(start, start + n, dtype=torch.int64) * 2654435761 + 12345
        module.import_keys_values("t", keys, torch.randn(n, dim, generator=g),
                                  torch.rand(n, module.optimizer_state_dim("t"), generator=g),
                                  scores=torch.arange(start, start + n))
    return dmp, module


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def measured(action):
    """(seconds, MB of peak RSS above the RSS before) of ``action()``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS
    before = _rss_kb("VmRSS:")
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    return seconds, (_rss_kb("VmHWM:") - before) / 1024


def paths(dmp, module, root: str):
    """name -> action, in the order they run (each load follows its save)."""
    def dcp_load():
        state = {"model": dmp.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(root, "dcp"))
        dmp.load_state_dict(state["model"])

    pt = os.path.join(root, "module.pt")
    return {
        "dcp.save": lambda: dcp.save({"model": dmp.state_dict()},
                                     checkpoint_id=os.path.join(root, "dcp")),
        "dcp.load": dcp_load,
        "DynamicEmbDump": lambda: DynamicEmbDump(os.path.join(root, "dump"), dmp,
                                                 allow_overwrite=True),
        "DynamicEmbLoad": lambda: DynamicEmbLoad(os.path.join(root, "dump"), dmp),
        "state_dict+torch.save": lambda: torch.save(module.state_dict(), pt),
        "torch.load+load_state_dict": lambda: module.load_state_dict(
            torch.load(pt, weights_only=True)),
    }


def main():
    args = parse_args()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    dmp, module = build(args.rows, args.dim)
    root = args.dir or tempfile.mkdtemp(prefix="state-dict-bench-")
    times, peaks = {}, {}
    try:
        for _ in range(args.reps):
            for name, action in paths(dmp, module, root).items():
                seconds, peak = measured(action)
                assert module.table_size("t") == args.rows, name  # no row lost
                times.setdefault(name, []).append(seconds)
                peaks.setdefault(name, []).append(peak)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    rows_mb = args.rows * (16 + 4 * 3 * args.dim) / 2**20
    print(f"{args.rows} rows, dim {args.dim}, Adam: {rows_mb:.0f} MiB of keys, scores, rows and states")
    print("| path | median s | rows/s | vs Dump/Load | median peak MiB above RSS |")
    print("|---|---|---|---|---|")
    for name in times:
        base = "DynamicEmbDump" if "save" in name or "Dump" in name else "DynamicEmbLoad"
        median = statistics.median(times[name])
        ratio = median / statistics.median(times[base])
        print(f"| {name} | {median:.2f} | {args.rows / median:.3g} | {ratio:.2f}x | "
              f"{statistics.median(peaks[name]):.0f} |")


if __name__ == "__main__":
    main()
