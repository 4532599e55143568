"""On a GPU: the host syncs of a steady training step, seen by PyTorch's own sync
debug mode, beside what the CPU guard counts (``test/cuda/test_step_syncs.py``: none),
a training step captured in a CUDA graph and replayed against eager training, and a
training step at the widest dims against the CPU backend.

Prints one JSON object: ``syncs`` (count and sites in dynamicemb of every
synchronizing call ``torch.cuda.set_sync_debug_mode("warn")`` reported) for a step
with ids present and a step with new ids, ``error_mode`` (whether a step ran under
``set_sync_debug_mode("error")``), ``graph`` (the largest difference between replays
of a captured step and eager steps of a twin: outputs, rows, optimizer states,
scores; and the clocks of both), and ``wide_dims`` (the largest difference from the
CPU module's output and rows, per dim). Run by ``benchmark/gpu_check.sh``.

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


def under_error_mode(module, ids, offsets) -> str:
    """'ok' if a step runs with every implicit sync an error, else the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(module, ids, offsets)
        return "ok"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"[:500]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def graph_against_eager(lookups: int, num_ids: int, replays: int = 8) -> dict:
    """A step captured with torch.cuda.graph (after a warm-up on a side stream, as
    PyTorch's recipe says), replayed with new ids, against a twin trained eagerly."""
    graphed, eager = module_on("cuda", capacity=4 * num_ids), module_on("cuda", capacity=4 * num_ids)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, num_ids, (lookups,), device="cuda", generator=gen)
               for _ in range(replays + 4)]
    offsets = torch.arange(0, lookups + 1, 4, device="cuda")
    static_ids = batches[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for ids in batches[:3]:
            static_ids.copy_(ids)
            step(graphed, static_ids, offsets)
    torch.cuda.current_stream().wait_stream(side)
    for ids in batches[:3]:
        step(eager, ids, offsets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records, runs nothing
        out = graphed(static_ids, offsets)
        out.sum().backward()
    worst = 0.0
    for ids in batches[3:]:
        static_ids.copy_(ids)
        graph.replay()
        worst = max(worst, float((out.detach() - step(eager, ids, offsets)).abs().max()))
    graphed.check_errors()
    a, b = graphed.export_keys_values("t0"), eager.export_keys_values("t0")
    oa, ob = torch.argsort(a.keys), torch.argsort(b.keys)
    return {"replays": len(batches) - 3, "output": worst,
            "same_keys": bool(torch.equal(a.keys[oa], b.keys[ob])),
            "rows": float((a.embeddings[oa] - b.embeddings[ob]).abs().max()),
            "states": float((a.optimizer_states[oa] - b.optimizer_states[ob]).abs().max()),
            "same_scores": bool(torch.equal(a.scores[oa], b.scores[ob])),
            "clocks": [list(graphed.table_clocks("t0")), list(eager.table_clocks("t0"))]}


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
        "error_mode": under_error_mode(module, warm, offsets),
        "graph": graph_against_eager(args.lookups, args.num_ids),
        "wide_dims": wide_dims([1536, 1537, 4096, MAX_DIM]),
    }, indent=1))


if __name__ == "__main__":
    main()
