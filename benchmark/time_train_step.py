"""The training step of one ``BatchedDynamicEmbeddingTables`` timed alone (no
reference beside it): for A/B runs of two builds in alternating processes, where a
ratio's partner would only add noise.

    python benchmark/time_train_step.py --optimizer rowwise_adagrad
"""

import argparse
import statistics
import time

import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions

OPTIMIZERS = {"sgd": DynamicEmbOptimType.EXACT_SGD, "adagrad": DynamicEmbOptimType.EXACT_ADAGRAD,
              "rowwise_adagrad": DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD,
              "adam": DynamicEmbOptimType.ADAM}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ids", type=int, default=1 << 20)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=args.dim, max_capacity=2 * args.ids)],
        optimizer=OPTIMIZERS[args.optimizer], learning_rate=0.01)
    offsets = torch.arange(args.batch + 1)
    # alternately uniform and power-law ids, as the guards' batches
    batches = [torch.randint(0, args.ids, (args.batch,)) if i % 2
               else (torch.rand(args.batch) ** 3 * args.ids).long() for i in range(8)]
    grad = torch.randn(args.batch, args.dim)

    def step(ids: torch.Tensor) -> None:
        module(ids, offsets).backward(grad)

    for ids in batches * 2:  # warm: rows inserted, buffers sized
        step(ids)
    times = []
    for r in range(args.steps):
        start = time.perf_counter()
        step(batches[r % len(batches)])
        times.append(time.perf_counter() - start)
    print(f"{args.optimizer} train step, batch {args.batch}, dim {args.dim}: "
          f"median {statistics.median(times) * 1e3:.2f} ms of {args.steps}")


if __name__ == "__main__":
    main()
