"""Where a GPU step's time goes: torch.profiler tables of one training step of
the batched-tables benchmark and of one ``find_or_insert``, by host time and by
device time (the input for the next optimization, not a benchmark). ``--emulated``:
the same on the CPU with the CUDA path emulated (host time only; for CI).

Example::

    python benchmark/profile_gpu_step.py --batch 65536 --num_embeddings 8388608
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from _accelerator import accelerator
from benchmark_gpu_tables import Dynamic, power_law_ids
from dynamicemb import ScoredHashTable


def report(prof, title: str, rows: int, device_time: bool) -> None:
    print(f"\n### {title}: by host time\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    if device_time:
        print(f"\n### {title}: by device time\n")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--num_embeddings", type=int, default=1 << 23)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--table_log2_slots", type=int, default=20,
                        help="the hash table's slots (and keys per call): 2 to this")
    parser.add_argument("--emulated", action="store_true",
                        help="on the CPU: the CUDA path emulated (host time only)")
    args = parser.parse_args()
    with accelerator(args.emulated) as acc:
        profile_both(acc, args)


def profile_both(acc, args) -> None:
    """Profiles the training steps, then the hash table's ``find_or_insert``."""
    device = acc.device
    activities = [ProfilerActivity.CPU] + ([] if acc.emulated else [ProfilerActivity.CUDA])
    gen = torch.Generator(device).manual_seed(0)
    module = Dynamic(args.num_embeddings, 128, "sgd", device)
    ids = power_law_ids(args.batch, args.num_embeddings, 1.05, gen)
    offsets = torch.arange(args.batch + 1, device=device)
    grad = torch.randn(args.batch, 128, device=device)
    for _ in range(3):
        module(ids, offsets).backward(grad)
    acc.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            module(ids, offsets).backward(grad)
        acc.synchronize()
    report(prof, f"{args.steps} train steps, batch {args.batch}", args.rows, not acc.emulated)

    capacity = 1 << args.table_log2_slots
    table = ScoredHashTable(capacity=capacity, value_dim=8, max_load_factor=1.0, device=device)
    keys = torch.randint(-(2**62), 2**62, (capacity * 3 // 4,), device=device, generator=gen)
    table.insert_or_assign(keys, torch.zeros(keys.numel(), 8, device=device))
    batch = keys[torch.randint(0, keys.numel(), (capacity,), device=device, generator=gen)]
    for _ in range(3):
        table.find_or_insert(batch)
    acc.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            table.find_or_insert(batch)
        acc.synchronize()
    report(prof, f"{args.steps} find_or_insert of {capacity} keys ({capacity} slots, load 0.75)",
           args.rows, not acc.emulated)

if __name__ == "__main__":
    main()
