"""The training step of one ``BatchedDynamicEmbeddingTables`` timed alone (no
reference beside it): for A/B runs of two builds in alternating processes, where a
ratio's partner would only add noise. ``--verbs`` also prints where the step's time
goes: the wall time of each backend verb per step (every verb blocks on the CPU).

    python benchmark/time_train_step.py --optimizer rowwise_adagrad --verbs
"""

import argparse
import collections
import statistics
import time

import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions
from dynamicemb.ops import for_device

OPTIMIZERS = {"sgd": DynamicEmbOptimType.EXACT_SGD, "adagrad": DynamicEmbOptimType.EXACT_ADAGRAD,
              "rowwise_adagrad": DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD,
              "adam": DynamicEmbOptimType.ADAM}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--ids", type=int, default=1 << 20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the rows' embedding_dtype")
    parser.add_argument("--verbs", action="store_true", help="time each backend verb too")
    args = parser.parse_args()
    torch.manual_seed(0)
    module = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=args.dim, max_capacity=2 * args.ids,
                                embedding_dtype=DTYPES[args.dtype])],
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
    spent = timed_verbs(for_device(torch.device("cpu"))) if args.verbs else {}
    times = []
    for r in range(args.steps):
        start = time.perf_counter()
        step(batches[r % len(batches)])
        times.append(time.perf_counter() - start)
    print(f"{args.optimizer} train step, {args.dtype} rows, batch {args.batch}, dim {args.dim}: "
          f"median {statistics.median(times) * 1e3:.2f} ms of {args.steps}")
    for verb, seconds in sorted(spent.items(), key=lambda item: -sum(item[1])):
        print(f"  {verb:<24} {sum(seconds) / args.steps * 1e3:7.3f} ms a step "
              f"({len(seconds) / args.steps:g} calls)")


def timed_verbs(backend) -> dict:
    """Wraps each public verb of ``backend`` (the instance the tables call) to record
    its wall times; returns {verb: [seconds, ...]}."""
    spent = collections.defaultdict(list)
    for name in dir(type(backend)):
        verb = getattr(backend, name)
        if name.startswith("_") or not callable(verb):
            continue

        def timed(*args, _verb=verb, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _verb(*args, **kwargs)
            finally:
                spent[_name].append(time.perf_counter() - start)
        setattr(backend, name, timed)
    return spent


if __name__ == "__main__":
    main()
