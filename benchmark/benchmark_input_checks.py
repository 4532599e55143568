"""What the module's separate finiteness check costs beside the training step it guards.

``BatchedDynamicEmbeddingTables`` refuses NaN/inf per-sample weights in the forward
(``_all_finite``: one float64 sum over the N weights) and a NaN/inf output gradient in
the backward. The gradient's check has no pass of its own (each row's summed gradient
is compared in the backward's first pass, ``sum_gradients``), so what the step pays
for it shows only beside FBGEMM in ``benchmark/guards.py`` (P2). This times,
interleaved in one loop, a weighted SUM training step (forward + backward with the
fused optimizer) and the weights' check alone on weights of the same shape, and
reports the medians and their ratio.

    PYTHONPATH=. python benchmark/benchmark_input_checks.py --batch 4096 --dim 64
"""

import argparse
import statistics
import time

import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions
from dynamicemb.embedding.step import _all_finite


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--features", type=int, default=4)
    p.add_argument("--bag", type=int, default=8, help="ids per bag")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--capacity", type=int, default=1 << 20, help="rows per table")
    args = p.parse_args()
    tables = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=args.dim, max_capacity=args.capacity) for _ in range(args.features)],
        optimizer=DynamicEmbOptimType.EXACT_ADAGRAD, learning_rate=0.01)
    n = args.batch * args.features * args.bag
    g = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, n + 1, args.bag)
    step_s, check_s = [], []
    for step in range(args.steps + 3):
        ids = torch.randint(0, args.capacity // 4, (n,), generator=g)
        weights = torch.rand(n, generator=g)
        grad = torch.randn(args.batch, args.features * args.dim, generator=g)
        t0 = time.perf_counter()
        out = tables(ids, offsets, weights)
        out.backward(grad)
        t1 = time.perf_counter()
        ok = _all_finite(weights)  # the module's separate check
        t2 = time.perf_counter()
        assert ok
        if step >= 3:  # warm-up steps are left out
            step_s.append(t1 - t0)
            check_s.append(t2 - t1)
    step_ms, check_ms = statistics.median(step_s) * 1e3, statistics.median(check_s) * 1e3
    print(f"batch {args.batch} x {args.features} features x {args.bag} ids, dim {args.dim}, "
          f"{torch.get_num_threads()} threads: train step {step_ms:.2f} ms (median of {args.steps}), "
          f"the weights' check {check_ms:.3f} ms, ratio {check_ms / step_ms:.4f}")


if __name__ == "__main__":
    main()
