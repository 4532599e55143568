"""Where a GPU step's time goes: torch.profiler tables of one training step of
the batched-tables benchmark and of one ``find_or_insert``, by host time and by
device time (the input for the next optimization, not a benchmark).

Example::

    python benchmark/profile_gpu_step.py --batch 65536 --num_embeddings 8388608
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark_gpu_tables import Dynamic, power_law_ids
from dynamicemb import ScoredHashTable


def report(prof, title: str, rows: int) -> None:
    print(f"\n### {title}: by host time\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    print(f"\n### {title}: by device time\n")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--num_embeddings", type=int, default=1 << 23)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    module = Dynamic(args.num_embeddings, 128, "sgd", device)
    ids = power_law_ids(args.batch, args.num_embeddings, 1.05, gen)
    offsets = torch.arange(args.batch + 1, device=device)
    grad = torch.randn(args.batch, 128, device=device)
    for _ in range(3):
        module(ids, offsets).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            module(ids, offsets).backward(grad)
        torch.cuda.synchronize()
    report(prof, f"{args.steps} train steps, batch {args.batch}", args.rows)

    table = ScoredHashTable(capacity=1 << 20, value_dim=8, max_load_factor=1.0, device=device)
    keys = torch.randint(-(2**62), 2**62, (3 << 18,), device=device, generator=gen)
    table.insert_or_assign(keys, torch.zeros(keys.numel(), 8, device=device))
    batch = keys[torch.randint(0, keys.numel(), (1 << 20,), device=device, generator=gen)]
    for _ in range(3):
        table.find_or_insert(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            table.find_or_insert(batch)
        torch.cuda.synchronize()
    report(prof, f"{args.steps} find_or_insert of 1M keys (1M slots, load 0.75)", args.rows)


if __name__ == "__main__":
    main()
