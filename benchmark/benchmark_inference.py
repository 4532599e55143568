"""Eval lookups/s of the serving module against the training module's eval path and a
static ``nn.EmbeddingBag`` of the same rows, and memory per row (CPU).

One table of ``--rows`` rows (ids 0..rows-1, so the static table holds the same rows
at the same indices), pooled SUM lookups of ``--features`` features x ``--batch``
bags x ``--pooling`` ids, ids drawn uniformly (90% stored, 10% unseen). The candidates
run interleaved, ``--repeats`` rounds; medians and ratios are printed.

    python benchmark/benchmark_inference.py                  # 1M rows, dim 64
    python benchmark/benchmark_inference.py --rows 100000 --repeats 5
"""

import argparse
import statistics
import time

import torch

from benchmark_batched_dynamicemb_tables import same_allocator_for_all
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
from dynamicemb.inference import InferenceEmbeddingTables


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--pooling", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    return parser.parse_args()


def training_module(rows: torch.Tensor, features: int) -> BatchedDynamicEmbeddingTables:
    """A training table (SGD: no optimizer state) holding ``rows`` at keys 0..n-1,
    looked up by ``features`` features, in eval mode."""
    n, dim = rows.shape
    module = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=1 << (2 * n - 1).bit_length())],
        ["t"], [0] * features)
    module.import_keys_values("t", torch.arange(n), rows)
    return module.eval()


class SortedKeys(torch.nn.Module):
    """The design not taken: keys sorted, ``searchsorted``, ``embedding_bag`` (unseen
    ids weigh 0, the zero eval initializer's row)."""

    def __init__(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        order = keys.argsort()
        self.keys, self.rows = keys[order], rows[order]

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self.keys, ids).clamp(max=self.keys.numel() - 1)
        found = (self.keys[pos] == ids).float()
        return torch.nn.functional.embedding_bag(pos, self.rows, offsets[:-1], mode="sum",
                                                 per_sample_weights=found)


def main():
    args = parse_args()
    heap = same_allocator_for_all()  # no page-fault lottery for fresh tensors
    torch.manual_seed(0)
    rows = torch.randn(args.rows, args.dim)
    module = training_module(rows, args.features)
    candidates = {
        "training eval": module,
        "inference fp32": InferenceEmbeddingTables.from_module(module),
        "inference fp16": InferenceEmbeddingTables.from_module(module, dtype=torch.float16),
        "inference bf16": InferenceEmbeddingTables.from_module(module, dtype=torch.bfloat16),
    }
    static = torch.nn.EmbeddingBag.from_pretrained(rows, mode="sum")
    candidates["sorted keys + searchsorted"] = SortedKeys(torch.arange(args.rows), rows)
    n = args.features * args.batch * args.pooling
    ids = torch.randint(0, args.rows * 10 // 9, (n,))
    offsets = torch.arange(0, n + 1, args.pooling)
    times = {name: [] for name in list(candidates) + ["nn.EmbeddingBag"]}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, m in candidates.items():
                start = time.perf_counter()
                m(ids, offsets)
                times[name].append(time.perf_counter() - start)
            start = time.perf_counter()  # ids past the rows: clamped (no unseen rows)
            static(ids.clamp(max=args.rows - 1), offsets[:-1])
            times["nn.EmbeddingBag"].append(time.perf_counter() - start)
    want = module(ids, offsets)
    assert torch.equal(candidates["inference fp32"](ids, offsets), want)
    # per bag, not per feature: (B * F, dim) against (B, F * dim)
    sorted_out = candidates["sorted keys + searchsorted"](ids, offsets)
    torch.testing.assert_close(sorted_out.reshape(args.features, args.batch, args.dim)
                               .transpose(0, 1).reshape(args.batch, -1), want)
    base = statistics.median(times["training eval"])
    print(f"{args.rows} rows, dim {args.dim}, {n} ids per call ({args.features} features x "
          f"{args.batch} bags x {args.pooling}), {torch.get_num_threads()} threads, "
          f"{args.repeats} interleaved rounds, glibc heap for large blocks: {heap}")
    print("| path | median ms | Mlookups/s | time / training eval |")
    print("|---|---|---|---|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.2f} | {n / med / 1e6:.3g} | {med / base:.2f} |")
    print("| path | bytes per row (index + rows) |")
    print("|---|---|")
    table = module._groups[0].table
    print(f"| training table (SGD, capacity {table.capacity()}) | "
          f"{sum(table.memory_bytes().values()) / args.rows:.1f} |")
    for name, m in candidates.items():
        if name.startswith("inference"):
            mem = m.memory_bytes()
            print(f"| {name} | {(mem['index'] + mem['rows']) / args.rows:.1f} "
                  f"({mem['index'] / args.rows:.1f} + {mem['rows'] / args.rows:.1f}) |")
    print(f"| sorted keys + searchsorted | {8 + rows.element_size() * args.dim:.1f} |")
    print(f"| nn.EmbeddingBag | {rows.element_size() * args.dim:.1f} |")


if __name__ == "__main__":
    main()
