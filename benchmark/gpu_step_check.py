"""On a GPU: the host syncs of a steady training step, seen by PyTorch's own sync
debug mode, beside what the CPU guard counts (``test/cuda/test_step_syncs.py``), and a
training step at the widest dims against the CPU backend.

Prints one JSON object: ``syncs`` (count and sites in dynamicemb of every
synchronizing call ``torch.cuda.set_sync_debug_mode("warn")`` reported) for a step
with ids present and a step with new ids, and ``wide_dims`` (the largest difference
from the CPU module's output and rows, per dim). Run by ``benchmark/gpu_check.sh``.

Example::

    python benchmark/gpu_step_check.py --lookups 65536
"""

import argparse
import json
import os
import traceback
import warnings
from collections import Counter

import torch

import dynamicemb
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions
from dynamicemb.ops.cuda import MAX_DIM

_PACKAGE = os.path.dirname(os.path.abspath(dynamicemb.__file__))


def _site(stack) -> str:
    for frame in reversed(stack):
        if os.path.abspath(frame.filename).startswith(_PACKAGE + os.sep):
            return f"{os.path.relpath(frame.filename, _PACKAGE)}:{frame.lineno} {frame.name}"
    return "outside dynamicemb"


def module_on(device, dim=128, capacity=1 << 20):
    return BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=capacity)],
        optimizer=DynamicEmbOptimType.ADAM, learning_rate=0.01, device=device)


def step(module, ids, offsets):
    out = module(ids, offsets)
    out.sum().backward()
    return out.detach()


def syncs_of_step(module, ids, offsets) -> dict:
    """Every synchronizing call of one step, by site."""
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites.append(_site(traceback.extract_stack()))

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(module, ids, offsets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"count": len(sites), "sites": dict(Counter(sites))}


def wide_dims(dims) -> dict:
    """Largest |CUDA - CPU| of the output and of the updated rows, per dim."""
    result = {}
    ids = torch.tensor([3, 5, 3, 9, 11, 5])
    offsets = torch.tensor([0, 2, 4, 6])
    for dim in dims:
        cpu = module_on("cpu", dim, 64)
        gpu = module_on("cuda", dim, 64)
        out_cpu = step(cpu, ids, offsets)
        out_gpu = step(gpu, ids.cuda(), offsets.cuda())
        rows_cpu = cpu.export_keys_values("t0")
        rows_gpu = gpu.export_keys_values("t0")
        order_cpu, order_gpu = torch.argsort(rows_cpu.keys), torch.argsort(rows_gpu.keys.cpu())
        result[dim] = {
            "output": float((out_gpu.detach().cpu() - out_cpu.detach()).abs().max()),
            "rows": float((rows_gpu.embeddings.cpu()[order_gpu]
                           - rows_cpu.embeddings[order_cpu]).abs().max()),
        }
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lookups", type=int, default=65536)
    p.add_argument("--num-ids", type=int, default=1 << 20)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    module = module_on("cuda", capacity=4 * args.num_ids)
    offsets = torch.arange(0, args.lookups + 1, 4, device="cuda")
    warm = torch.randint(0, args.num_ids, (args.lookups,), device="cuda", generator=gen)
    for _ in range(3):
        step(module, warm, offsets)
    new = warm + args.num_ids
    print(json.dumps({
        "device": torch.cuda.get_device_name(),
        # the first measured step may see the caching allocator's own syncs
        "syncs": {"ids_present": syncs_of_step(module, warm, offsets),
                  "ids_present_again": syncs_of_step(module, warm, offsets),
                  "new_ids": syncs_of_step(module, new, offsets)},
        "wide_dims": wide_dims([1536, 1537, 4096, MAX_DIM]),
    }, indent=1))


if __name__ == "__main__":
    main()
