"""The cost of row lifetime (issue 28), measured side by side in one run.

1. A training step with and without a ``ttl``: the issue-3 configuration of
   ``benchmark_batched_dynamicemb_tables.py`` (SGD, batch 65,536, one feature, 1M ids,
   power law 1.05, dim 128, all rows resident, LRU scores), two modules stepped in
   turn, iteration by iteration. The TTL module's clock starts far enough past its
   ttl that every batch pays the expiry check (no row expires: the check, a compare
   per hit in the inserting kernel, is all there is to pay). Medians and the paired
   ratio (median of per-step ratios).
2. A sweep per million rows: ``ScoredHashTable.expire()`` (one kernel pass over the
   slots) against the best way without it (``export_batch`` of the expired rows,
   then ``erase`` of their keys), on twin tables of 1M rows of which a fraction has
   expired.

Example::

    python benchmark/benchmark_lifetime.py --num_iterations 40
"""

import argparse
import json
import statistics
import time
from typing import Dict, List

import torch

from benchmark_batched_dynamicemb_tables import make_batches, paired_ratio, time_modules
from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbOptimType,
                        DynamicEmbScoreStrategy, DynamicEmbTableOptions, ScoredHashTable,
                        TableClocks)

#: The TTL module's clock starts here, its ttl below it: every batch checks expiry.
START_CLOCK, TTL = 1_000_000, 100_000


def make_module(args, ttl) -> BatchedDynamicEmbeddingTables:
    options = DynamicEmbTableOptions(dim=args.embedding_dim, max_capacity=2 * args.num_embeddings,
                                     max_load_factor=1.0, ttl=ttl)
    module = BatchedDynamicEmbeddingTables([options], feature_table_map=[0] * args.num_features,
                                           optimizer=DynamicEmbOptimType.EXACT_SGD,
                                           learning_rate=0.01)
    module.set_table_clocks("t0", TableClocks(0, START_CLOCK, 0))
    gen = torch.Generator().manual_seed(1)
    chunk = 1 << 18
    for start in range(0, args.num_embeddings, chunk):
        keys = torch.arange(start, min(start + chunk, args.num_embeddings), dtype=torch.int64)
        rows = torch.empty(keys.numel(), args.embedding_dim).uniform_(-0.01, 0.01, generator=gen)
        module.import_keys_values("t0", keys, rows)
    assert module.table_size("t0") == args.num_embeddings
    return module


def step_cost(args) -> Dict:
    batches = make_batches(args, args.batch_size, args.num_embeddings)
    modules = {"no_ttl": make_module(args, None), "ttl": make_module(args, TTL)}
    medians, train = time_modules(modules, batches, args)
    expired = modules["ttl"].cache_metrics()["t0"].expired
    assert expired == 0, "the TTL module must pay the check without expiring rows"
    return {"medians_ms": medians,
            "train_ratio(ttl/no_ttl)": round(medians["ttl"]["train"] / medians["no_ttl"]["train"], 3),
            "train_ratio_paired(ttl/no_ttl)": paired_ratio(train["ttl"], train["no_ttl"])}


def filled_table(rows: int, expired_fraction: float) -> ScoredHashTable:
    """``rows`` keys in 2x slots; the first ``expired_fraction`` of them have expired."""
    table = ScoredHashTable(capacity=2 * rows, bucket_capacity=128, max_load_factor=1.0,
                            score_strategy=DynamicEmbScoreStrategy.STEP, ttl=1)
    old = int(rows * expired_fraction)
    table.set_step(1)
    table.find_or_insert(torch.arange(old, dtype=torch.int64))
    table.set_step(3)
    table.find_or_insert(torch.arange(old, rows, dtype=torch.int64))
    return table


def sweep_by_kernel(table: ScoredHashTable) -> int:
    return table.expire().keys.numel()


def sweep_by_export_and_erase(table: ScoredHashTable) -> int:
    """The same rows freed with the verbs that existed before: find the expired slots
    in the scores, then erase their keys."""
    memory = table._memory  # the scores of every slot, as export_batch reads them
    slots = table._ops.occupied_slots(memory=memory, start=0, end=table.capacity())
    dead = slots[memory.scores[slots] < table.expired_before(table.now)]
    return int(table.erase(memory.keys[dead], memory.table_ids[dead]).sum())


def sweep_cost(args) -> List[Dict]:
    out = []
    for fraction in args.expired_fractions:
        times = {"expire_kernel": [], "export_then_erase": []}
        for rep in range(args.sweep_repeats):
            for name, sweep in (("expire_kernel", sweep_by_kernel),
                                ("export_then_erase", sweep_by_export_and_erase))[::1 - 2 * (rep % 2)]:
                table = filled_table(args.sweep_rows, fraction)
                t0 = time.perf_counter()
                freed = sweep(table)
                times[name].append(time.perf_counter() - t0)
                assert freed == int(args.sweep_rows * fraction) and table.expire().keys.numel() == 0
        med = {k: round(statistics.median(v) * 1e3 / (args.sweep_rows / 1e6), 2)
               for k, v in times.items()}
        out.append({"expired_fraction": fraction, "ms_per_million_rows": med,
                    "ratio(kernel/alternative)": round(med["expire_kernel"] / med["export_then_erase"], 3)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=65536)
    parser.add_argument("--num_embeddings", type=int, default=1 << 20)
    parser.add_argument("--embedding_dim", type=int, default=128)
    parser.add_argument("--num_features", type=int, default=1)
    parser.add_argument("--pooling_factor", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--num_iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--distinct_batches", type=int, default=8)
    parser.add_argument("--sweep_rows", type=int, default=1 << 20)
    parser.add_argument("--sweep_repeats", type=int, default=6)
    parser.add_argument("--expired_fractions", type=float, nargs="+", default=[0.0, 0.1, 0.5])
    parser.add_argument("--skip_step", action="store_true")
    args = parser.parse_args()
    result = {"threads": torch.get_num_threads()}
    if not args.skip_step:
        result["step"] = step_cost(args)
    result["sweep"] = sweep_cost(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
