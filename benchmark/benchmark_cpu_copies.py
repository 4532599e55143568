"""The copies of the CPU kernels side by side: one table trained by each in turn.

``setup.py`` builds the CPU kernels once per x86-64 level (``dynamicemb.ops.cpu_kernels``)
or once for ``DYNAMICEMB_CPU_ARCH``. The copies compile the same sources, so they share
the tables' memory layout: this script drives one ``BatchedDynamicEmbeddingTables``
(pre-filled, power-law ids, as ``benchmark_batched_dynamicemb_tables.py``) with each copy
in turn, step by step, beside FBGEMM's CPU table, and reports each copy's median train
step and its paired ratio (median of per-step ratios) to the first copy and to FBGEMM.

To compare the dispatched build with one built for this machine only, build a second
tree with ``DYNAMICEMB_CPU_ARCH=native`` (it gets ``_C_local``), copy the dispatched
copies' ``.so`` files beside it, and run from there::

    DYNAMICEMB_CPU_ARCH=native python setup.py build_ext --inplace
    cp <dispatched tree>/dynamicemb/_C_*.so dynamicemb/
    PYTHONPATH=. python benchmark/benchmark_cpu_copies.py --copies local x86_64_v3
"""

import argparse
import json
import platform

import torch

from _report import write_report
from benchmark_batched_dynamicemb_tables import (
    OPTIMIZERS,
    make_batches,
    make_dynamicemb,
    make_torchrec,
    paired_ratio,
    same_allocator_for_all,
    time_modules,
)

from dynamicemb.ops import cpu_kernels, for_device


class WithKernels(torch.nn.Module):
    """``module`` run by one copy of the CPU kernels (swapped in before each forward;
    the backward that follows runs on the same copy)."""

    def __init__(self, module: torch.nn.Module, kernels) -> None:
        super().__init__()
        self.module, self.kernels = module, kernels

    def forward(self, indices, offsets):
        for_device("cpu").kernels = self.kernels
        return self.module(indices, offsets)


def run(args, optimizer: str) -> list:
    """One row per copy: its medians and its paired train ratios."""
    batches = make_batches(args, args.batch_size, args.num_embeddings)
    dynamic = make_dynamicemb(args, args.num_embeddings, optimizer)
    modules = {}
    static = make_torchrec(args, args.num_embeddings, optimizer)
    if static is not None:
        modules["torchrec"] = static
    for copy in args.copies:
        modules[copy] = WithKernels(dynamic, cpu_kernels.load_copy(copy))
    original = for_device("cpu").kernels
    try:
        timed, train = time_modules(modules, batches, args)
    finally:
        for_device("cpu").kernels = original
    first = args.copies[0]
    return [{
        "optimizer": optimizer, "copy": copy, "isa": modules[copy].kernels.isa.replace("_", "-"),
        **{f"{phase}(ms)": timed[copy][phase] for phase in ("eval", "forward", "backward", "train")},
        f"train_paired(/{first})": paired_ratio(train[copy], train[first]),
        "train_paired(/torchrec)": paired_ratio(train[copy], train["torchrec"]) if static else None,
    } for copy in args.copies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", nargs="+", default=cpu_kernels.runnable(),
                        choices=cpu_kernels.COPIES, help="default: every copy this CPU runs")
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=sorted(OPTIMIZERS))
    parser.add_argument("--batch_size", type=int, default=65536)
    parser.add_argument("--num_embeddings", type=int, default=2_000_000)
    parser.add_argument("--embedding_dim", type=int, default=128)
    parser.add_argument("--num_features", type=int, default=1)
    parser.add_argument("--pooling_factor", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--num_iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--distinct_batches", type=int, default=8)
    parser.add_argument("--out", default="benchmark/out/cpu_copies")
    args = parser.parse_args()
    heap_only = same_allocator_for_all()
    rows = []
    for optimizer in args.optimizers:
        for row in run(args, optimizer):
            rows.append(row)
            print(json.dumps(row), flush=True)
    cols = list(rows[0])
    table = "\n".join(["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)] + [
        "| " + " | ".join("n/a" if r[c] is None else str(r[c]) for c in cols) + " |"
        for r in rows]) + "\n"
    meta = {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "heap_only_allocator": heap_only, "machine": platform.machine(),
            "unit": "ms, median", "argv": vars(args)}
    write_report(args.out, meta, rows, table)
    print("\n" + table)


if __name__ == "__main__":
    main()
