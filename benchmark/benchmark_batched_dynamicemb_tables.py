"""BatchedDynamicEmbeddingTables beside TorchRec's static table, in one run.

Reproduces the upstream table "Benchmark BatchedDynamicEmbeddingTables" (same
columns). The TorchRec column times FBGEMM's table-batched embedding
(``SplitTableBatchedEmbeddingBagsCodegen``), the kernel behind TorchRec's FUSED
compute kernel, on the same device with the same optimizer, ids and batches.
Ids follow a power law (alpha 1.05) over ``[0, num_embeddings)``; both tables
hold every row before timing (the dynamic table is pre-filled).

Per iteration: ``forward`` (training forward), ``backward`` (backward with the
fused optimizer), ``train`` (both), and ``eval`` (no-grad forward in eval mode);
each reported as the median over iterations, in milliseconds. Two train ratios:
of the medians, and paired (the median of per-iteration ratios, steps timed back to
back), which moves less with the VM's noise. All modules of a
configuration (TorchRec's, the all-resident dynamic table, each cache size) step
in turn, iteration by iteration, so noise falls on all of them alike; large
buffers come from the heap for all of them (see ``same_allocator_for_all``).

Example::

    python benchmark/benchmark_batched_dynamicemb_tables.py \\
        --batch_sizes 65536 --num_embeddings 1048576 --optimizers sgd adam
"""

import argparse
import ctypes
import json
import platform
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch

from _report import write_report

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbOptimType,
    DynamicEmbTableOptions,
)

OPTIMIZERS = {
    "sgd": DynamicEmbOptimType.EXACT_SGD,
    "adagrad": DynamicEmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": DynamicEmbOptimType.ADAM,
}
COLUMNS = [
    "caching", "batch_size", "num_embeddings_per_feature", "hbm_for_embeddings",
    "optimizer_type", "feature_distribution-alpha", "embedding_dim", "num_iterations",
    "cache_algorithm", "use_index_dedup",
    "eval(torchrec)", "forward(torchrec)", "backward(torchrec)", "train(torchrec)",
    "eval(dynamicemb)", "forward(dynamicemb)", "backward(dynamicemb)", "train(dynamicemb)",
]


def power_law_ids(n: int, num_embeddings: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` ids in ``[0, num_embeddings)`` with P(id = k) ~ (k + 1)^-alpha.

    Inverse-CDF sampling of the continuous power law on [1, num_embeddings + 1).
    """
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    a = 1.0 - alpha
    x = ((float(num_embeddings + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return (x.floor().long() - 1).clamp_(0, num_embeddings - 1)


def make_batches(args, batch_size: int, num_embeddings: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    lookups = batch_size * args.num_features * args.pooling_factor
    offsets = torch.arange(0, lookups + 1, args.pooling_factor, dtype=torch.int64)
    return [
        (power_law_ids(lookups, num_embeddings, args.alpha, gen), offsets)
        for _ in range(min(args.num_iterations + args.warmup, args.distinct_batches))
    ]


STATE_FLOATS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 0, "adam": 2}  # x dim, +1 rowwise


def row_bytes(args, optimizer: str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a stored row: the embedding in ``dtype`` padded to 4 bytes, then the
    float32 optimizer state."""
    state = STATE_FLOATS[optimizer] * args.embedding_dim + (optimizer == "rowwise_adagrad")
    return -(-args.embedding_dim * dtype.itemsize // 4) * 4 + 4 * state


def make_dynamicemb(args, num_embeddings: int, optimizer: str,
                    cache_rows: Optional[int] = None,
                    dtype: torch.dtype = torch.float32) -> BatchedDynamicEmbeddingTables:
    # A bucketed hash table cannot hold N keys in exactly N slots (buckets fill
    # unevenly), so the dynamic table gets 2x slots: its real bytes are reported.
    options = DynamicEmbTableOptions(
        dim=args.embedding_dim, max_capacity=2 * num_embeddings, max_load_factor=1.0,
        caching=cache_rows is not None, embedding_dtype=dtype,
        local_hbm_for_values=(None if cache_rows is None
                              else cache_rows * row_bytes(args, optimizer, dtype)))
    module = BatchedDynamicEmbeddingTables(
        [options], feature_table_map=[0] * args.num_features,
        optimizer=OPTIMIZERS[optimizer], learning_rate=0.01)
    gen = torch.Generator().manual_seed(1)
    chunk = 1 << 18
    for start in range(0, num_embeddings, chunk):
        keys = torch.arange(start, min(start + chunk, num_embeddings), dtype=torch.int64)
        rows = torch.empty(keys.numel(), args.embedding_dim).uniform_(-0.01, 0.01, generator=gen)
        module.import_keys_values("t0", keys, rows)
    assert module.table_size("t0") == num_embeddings, "pre-fill must store every row"
    return module


def make_torchrec(args, num_embeddings: int, optimizer: str,
                  weights_precision: str = "FP32") -> Optional[torch.nn.Module]:
    """FBGEMM's CPU TBE with the same optimizer and ``weights_precision`` (a ``SparseType``
    name; FP16 rounds stochastically, FBGEMM's default), or None where it has none (Adam
    on CPU)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    cpu_optimizers = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }
    if optimizer not in cpu_optimizers:
        return None
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(num_embeddings, args.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=[0] * args.num_features,
        optimizer=cpu_optimizers[optimizer],
        learning_rate=0.01,
        weights_precision=SparseType[weights_precision],
    )


def time_modules(modules: Dict[str, torch.nn.Module], batches,
                 args) -> Tuple[Dict[str, Dict[str, float]], Dict[str, List[float]]]:
    """Median ms of eval, training forward, backward and train of each module, and
    each module's train times per iteration (seconds).

    Iterations are interleaved across the modules (one step of each in turn), so
    that the machine's noise falls on all of them alike and their ratios stay fair.
    """
    num_bags = batches[0][1].numel() - 1
    grad = torch.randn(num_bags // args.num_features, args.num_features * args.embedding_dim)
    times = {name: {p: [] for p in ("eval", "forward", "backward", "train")} for name in modules}
    for module in modules.values():
        module.train()
    for it in range(args.warmup + args.num_iterations):
        indices, offsets = batches[it % len(batches)]
        for name, module in modules.items():
            t0 = time.perf_counter()
            out = module(indices, offsets)
            t1 = time.perf_counter()
            out.backward(grad)
            t2 = time.perf_counter()
            del out
            if it >= args.warmup:
                times[name]["forward"].append(t1 - t0)
                times[name]["backward"].append(t2 - t1)
                times[name]["train"].append(t2 - t0)
    for module in modules.values():
        module.eval()
    with torch.no_grad():
        for it in range(args.warmup + args.num_iterations):
            indices, offsets = batches[it % len(batches)]
            for name, module in modules.items():
                t0 = time.perf_counter()
                module(indices, offsets)
                if it >= args.warmup:
                    times[name]["eval"].append(time.perf_counter() - t0)
    medians = {name: {p: round(statistics.median(xs) * 1e3, 3) for p, xs in phases.items()}
               for name, phases in times.items()}
    return medians, {name: phases["train"] for name, phases in times.items()}


def paired_ratio(mine: List[float], theirs: List[float]) -> float:
    """Median over iterations of mine[i] / theirs[i]: steps timed back to back share
    the machine's state of the moment, so this ratio shifts less with the VM's noise
    than the ratio of the two medians."""
    return round(statistics.median(a / b for a, b in zip(mine, theirs)), 3)


def describe(args, batch_size, num_embeddings, optimizer, caching, device_bytes) -> Dict:
    return {
        "caching": caching,
        "batch_size": batch_size,
        "num_embeddings_per_feature": num_embeddings,
        "hbm_for_embeddings": device_bytes,
        "optimizer_type": optimizer,
        "feature_distribution-alpha": f"pow-law-{args.alpha}",
        "embedding_dim": args.embedding_dim,
        "num_iterations": args.num_iterations,
        "cache_algorithm": "lru",
        "use_index_dedup": False,
    }


def run_config(args, batch_size: int, num_embeddings: int, optimizer: str) -> List[Dict]:
    """The all-resident row, then one row per cache fraction; TorchRec's static table
    (no cache) and every dynamic layout are timed together, interleaved."""
    batches = make_batches(args, batch_size, num_embeddings)
    touched = torch.cat([ids for ids, _ in batches]).unique().numel()
    modules: Dict[str, torch.nn.Module] = {}
    static = make_torchrec(args, num_embeddings, optimizer)
    if static is not None:
        modules["torchrec"] = static
    layouts = {None: None}
    for fraction in args.cache_fractions:
        layouts[fraction] = max(16, int(fraction * touched))
    for fraction, cache_rows in layouts.items():
        modules[fraction] = make_dynamicemb(args, num_embeddings, optimizer, cache_rows)
    timed, train_times = time_modules(modules, batches, args)
    t_static = timed.get("torchrec")
    rows = []
    for fraction, cache_rows in layouts.items():
        dynamic, t_dynamic = modules[fraction], timed[fraction]
        device_bytes = (num_embeddings * row_bytes(args, optimizer) if cache_rows is None
                        else cache_rows * row_bytes(args, optimizer))
        row = describe(args, batch_size, num_embeddings, optimizer, fraction is not None,
                       device_bytes)
        for phase in ("eval", "forward", "backward", "train"):
            row[f"{phase}(torchrec)"] = t_static[phase] if t_static else None
            row[f"{phase}(dynamicemb)"] = t_dynamic[phase]
        metrics = dynamic.cache_metrics()["t0"]
        row["cache_fraction_of_touched"] = fraction
        row["cache_hit_rate"] = round(metrics.hit_rate, 4) if fraction is not None else None
        row["dynamicemb_table_bytes"] = sum(dynamic._groups[0].table.memory_bytes().values())
        row["train_ratio(dynamicemb/torchrec)"] = (
            round(t_dynamic["train"] / t_static["train"], 3) if t_static else None)
        row["train_ratio_paired(dynamicemb/torchrec)"] = (
            paired_ratio(train_times[fraction], train_times["torchrec"]) if t_static else None)
        row["train_ratio(vs all-resident)"] = round(t_dynamic["train"] / timed[None]["train"], 3)
        rows.append(row)
    return rows


def markdown(rows: List[Dict]) -> str:
    cols = COLUMNS + ["cache_hit_rate", "train_ratio(dynamicemb/torchrec)",
                      "train_ratio_paired(dynamicemb/torchrec)", "train_ratio(vs all-resident)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("n/a" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["eval", "forward", "backward", "train"]
    cols = min(3, len(rows))
    grid_rows = (len(rows) + cols - 1) // cols
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.5 * cols, 3.4 * grid_rows), squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, rows):
        xs = range(len(phases))
        static = [r[f"{p}(torchrec)"] or 0 for p in phases]
        dynamic = [r[f"{p}(dynamicemb)"] for p in phases]
        ax.bar([x - 0.2 for x in xs], static, 0.4, label="torchrec (static TBE)")
        ax.bar([x + 0.2 for x in xs], dynamic, 0.4, label="dynamicemb")
        ax.set_xticks(list(xs), phases)
        ax.set_ylabel("ms (median)")
        cache = f" cache {r['cache_fraction_of_touched']:.0%}" if r["caching"] else ""
        ax.set_title(f"{r['optimizer_type']} B={r['batch_size']} N={r['num_embeddings_per_feature']}"
                     f"{cache}", fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def same_allocator_for_all() -> bool:
    """Large buffers come from the heap and stay there (glibc: no mmap, no trim).

    Otherwise whether a module's fresh 32 MB output costs ~8,000 page faults depends
    on the allocation history of the whole process: TorchRec's table paid them in
    some runs and not in others (2x on its times), while dynamicemb recycles its
    outputs and never does. Returns False where mallopt is not available.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[65536])
    parser.add_argument("--num_embeddings", type=int, nargs="+", default=[1 << 20])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "rowwise_adagrad", "adam"],
                        choices=sorted(OPTIMIZERS))
    parser.add_argument("--cache_fractions", type=float, nargs="*", default=[0.1, 0.5],
                        help="extra rows with a device cache of this fraction of the touched keys")
    parser.add_argument("--embedding_dim", type=int, default=128)
    parser.add_argument("--num_features", type=int, default=1)
    parser.add_argument("--pooling_factor", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--num_iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--distinct_batches", type=int, default=8)
    parser.add_argument("--out", default="benchmark/out/batched_dynamicemb_tables")
    args = parser.parse_args()
    heap_only = same_allocator_for_all()

    rows = []
    for optimizer in args.optimizers:
        for num_embeddings in args.num_embeddings:
            for batch_size in args.batch_sizes:
                for row in run_config(args, batch_size, num_embeddings, optimizer):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "heap_only_allocator": heap_only,
            "machine": platform.machine(), "device": "cpu", "unit": "ms, median",
            "argv": vars(args)}
    table = markdown(rows)
    write_report(args.out, meta, rows, table)
    plot(rows, args.out + ".png")
    print("\n" + table)
    print(f"wrote {args.out}.json, .md, .png")


if __name__ == "__main__":
    main()
