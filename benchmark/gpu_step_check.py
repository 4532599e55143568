"""On a GPU: the host syncs of a steady training step and a CUDA graph of it against
eager training, for every layout the one step covers (all rows in HBM, a device
cache over host rows, a placement tier, rows in host memory alone), and training at
the widest dims against the CPU backend.

Parts (``--parts``, in this order by default):

- ``syncs``: per layout and optimizer, after warm-up, the synchronizing calls of a
  step as ``torch.cuda.set_sync_debug_mode("warn")`` reports them (ids present,
  again, and new ids), whether a step runs under ``set_sync_debug_mode("error")``,
  and the profiler's count of the CUDA calls that make the host wait (runtime and
  driver ``*Synchronize``, synchronous ``cudaMemcpy``; CuPy's and
  ``Event.synchronize()`` included, which the debug mode misses) with their
  durations, and of device-to-host copies. Expected: no sync in dynamicemb, none
  at all once warm, the error mode passes, and the only wait is the one
  ``cudaEventSynchronize`` of the offsets check's word (``embedding/input_errors.py``:
  the previous step's copy, long done) and no copy into pageable memory.
- ``graph``: per layout and optimizer, a step captured with ``torch.cuda.graph``
  (after a warm-up on a side stream) and replayed with new ids, against a twin
  trained eagerly on the same batches: outputs, keys, rows, optimizer states,
  scores, clocks, steps, sizes and cache metrics must be equal, bit for bit (the
  kernels' float sums run in a fixed order; their atomics count integers only).
- ``wide_dims``: the output and rows of one Adam step at dims up to the backend's
  maximum against the CPU module (needs the CPU extension built).

Each part's result is one JSON line, printed and appended to ``--out``.jsonl as soon
as it is known (a crash or a timeout loses only what had not run); ``--out``.json
holds them all at the end. The exit code is 1 when any expectation failed (a wrong
replay, a sync, an error), after every part ran. ``--emulated`` runs all of it on the
CPU at tiny sizes (the CUDA path emulated, the graph stand-in; ``_accelerator.py``).

Example::

    python benchmark/gpu_step_check.py --lookups 65536 --out benchmark/out/gpu/steps
    python benchmark/gpu_step_check.py --emulated --lookups 512 --num-ids 256 --dim 8
"""

import argparse
import json
import os
import sys
import traceback
from typing import Callable, Dict, List

import torch

from _accelerator import Accelerator, accelerator

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions
from dynamicemb.ops.cuda import MAX_DIM

OPTIMIZERS = {"adam": DynamicEmbOptimType.ADAM, "sgd": DynamicEmbOptimType.EXACT_SGD}
STATE_FLOATS = {"adam": 2, "sgd": 0}  # optimizer floats stored beside each dim float
LAYOUTS = ("all-hbm", "cache", "placed", "host-rows")
PARTS = ("syncs", "graph", "wide_dims")
BAG = 4
#: The one wait a steady step makes by design: the next call waits for the event of
#: the previous step's offsets-check copy (``InputErrors.raise_if_refused``).
EXPECTED_WAITS = {"cudaEventSynchronize": 1}


def layout_options(layout: str, optimizer: str, dim: int, capacity: int) -> Dict:
    """The table options of ``layout``: a device budget of a quarter of the rows for
    a cache or a placement tier, none for rows in host memory alone."""
    options = dict(dim=dim, max_capacity=capacity, init_capacity=capacity)
    row_bytes = dim * 4 * (1 + STATE_FLOATS[optimizer])
    if layout in ("cache", "placed"):
        options.update(local_hbm_for_values=row_bytes * (capacity // 4),
                       caching=layout == "cache")
    elif layout == "host-rows":
        options.update(local_hbm_for_values=0, caching=False)
    elif layout != "all-hbm":
        raise ValueError(f"unknown layout {layout!r}")
    return options


def make_module(device, layout: str, optimizer: str, dim: int,
                capacity: int) -> BatchedDynamicEmbeddingTables:
    return BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(**layout_options(layout, optimizer, dim, capacity))],
        optimizer=OPTIMIZERS[optimizer], learning_rate=0.01, device=device)


def forward_backward(module, ids, offsets) -> torch.Tensor:
    out = module(ids, offsets)
    out.sum().backward()
    return out


def step(module, ids, offsets) -> torch.Tensor:
    return forward_backward(module, ids, offsets).detach()


def syncs_part(acc: Accelerator, layout: str, optimizer: str, args) -> Dict:
    """The syncs and waits of steady steps of one layout (see the module docstring)."""
    module = make_module(acc.device, layout, optimizer, args.dim, 4 * args.num_ids)
    gen = torch.Generator(device=acc.device).manual_seed(0)
    offsets = torch.arange(0, args.lookups + 1, BAG, device=acc.device)
    warm = torch.randint(0, args.num_ids, (args.lookups,), device=acc.device, generator=gen)
    for _ in range(3):
        step(module, warm, offsets)
    new = warm + args.num_ids  # the table has room for them (capacity 4 x num_ids)
    run = lambda ids: (lambda: step(module, ids, offsets))  # noqa: E731
    # the first measured step may see the caching allocator's own syncs
    syncs = {"ids_present": acc.sync_sites(run(warm)),
             "ids_present_again": acc.sync_sites(run(warm)),
             "new_ids": acc.sync_sites(run(new))}
    error_mode = acc.under_error_mode(run(warm))
    waits = acc.profiled_waits(run(warm))
    failures = [f"{when}: sync at {site}" for when, found in syncs.items()
                for site in found["sites"] if site != "outside dynamicemb"]
    if syncs["ids_present_again"]["count"]:
        failures.append(f"a warm step synced: {syncs['ids_present_again']['sites']}")
    if error_mode != "ok":
        failures.append(f"error mode: {error_mode}")
    for name, count in waits["waits"].items():
        if count > EXPECTED_WAITS.get(name, 0):
            failures.append(f"profiler: {count} x {name}")
    pageable = {k: v for k, v in waits["device_to_host"].items() if "Pageable" in k}
    if pageable:
        failures.append(f"profiler: copies into pageable memory {pageable}")
    if not waits["window_found"]:
        failures.append("profiler: the step's range was not recorded")
    return {"syncs": syncs, "error_mode": error_mode, "profiler": waits,
            "failures": failures}


def _exported(module) -> Dict[str, torch.Tensor]:
    rows = module.export_keys_values("t0")
    order = torch.argsort(rows.keys)
    return {"keys": rows.keys[order], "rows": rows.embeddings[order],
            "states": rows.optimizer_states[order], "scores": rows.scores[order]}


def graph_part(acc: Accelerator, layout: str, optimizer: str, args) -> Dict:
    """A captured step replayed against an eager twin (see the module docstring)."""
    capacity = 4 * args.num_ids
    graphed = make_module(acc.device, layout, optimizer, args.dim, capacity)
    eager = make_module(acc.device, layout, optimizer, args.dim, capacity)
    gen = torch.Generator(device=acc.device).manual_seed(1)
    batches = [torch.randint(0, 2 * args.num_ids, (args.lookups,), device=acc.device,
                             generator=gen) for _ in range(args.replays + 3)]
    offsets = torch.arange(0, args.lookups + 1, BAG, device=acc.device)
    static_ids = batches[0].clone()
    with acc.side_stream():  # PyTorch's recipe: warm up on a side stream
        for ids in batches[:3]:
            static_ids.copy_(ids)
            step(graphed, static_ids, offsets)
    for ids in batches[:3]:
        step(eager, ids, offsets)
    graph, out = acc.capture(lambda: forward_backward(graphed, static_ids, offsets))
    if acc.capture_runs_step:  # the stand-in ran the captured batch once more
        step(eager, static_ids, offsets)
    worst = 0.0
    for ids in batches[3:]:
        static_ids.copy_(ids)
        graph.replay()
        worst = max(worst, float((out.detach() - step(eager, ids, offsets)).abs().max()))
    graphed.check_errors()
    a, b = _exported(graphed), _exported(eager)
    same_keys = torch.equal(a["keys"], b["keys"])
    diffs = {"output": worst}
    for name in ("rows", "states"):
        diffs[name] = (float((a[name] - b[name]).abs().max()) if same_keys and a[name].numel()
                       else (0.0 if same_keys else None))
    same = {"keys": same_keys,
            "scores": same_keys and torch.equal(a["scores"], b["scores"]),
            "clocks": tuple(graphed.table_clocks("t0")) == tuple(eager.table_clocks("t0")),
            "train_steps": graphed.train_steps == eager.train_steps,
            "size": graphed.table_size("t0") == eager.table_size("t0"),
            "cache_metrics": graphed.cache_metrics() == eager.cache_metrics()}
    failures = [f"{k} differ by {v}" for k, v in diffs.items() if v != 0.0]
    failures += [f"{k} differ" for k, ok in same.items() if not ok]
    return {"replays": args.replays, "rows_compared": int(a["keys"].numel()),
            "max_abs_diff": diffs, "equal": same,
            "clocks": [list(graphed.table_clocks("t0")), list(eager.table_clocks("t0"))],
            "failures": failures}


def wide_dims_part(acc: Accelerator, dims: List[int]) -> Dict:
    """Largest |device - CPU| of one Adam step's output and rows, per dim."""
    result, failures = {}, []
    ids = torch.tensor([3, 5, 3, 9, 11, 5])
    offsets = torch.tensor([0, 2, 4, 6])
    for dim in dims:
        with acc.cpu_reference():
            cpu = make_module("cpu", "all-hbm", "adam", dim, 64)
            out_cpu = step(cpu, ids, offsets)
            rows_cpu = _exported(cpu)
        dev = make_module(acc.device, "all-hbm", "adam", dim, 64)
        out_dev = step(dev, ids.to(acc.device), offsets.to(acc.device)).cpu()
        rows_dev = {k: v.cpu() for k, v in _exported(dev).items()}
        result[dim] = {"output": float((out_dev - out_cpu).abs().max()),
                       "rows": float((rows_dev["rows"] - rows_cpu["rows"]).abs().max()),
                       "same_keys": torch.equal(rows_dev["keys"], rows_cpu["keys"])}
        # sums run in one order on both backends: only a fused multiply-add may differ
        if not result[dim]["same_keys"] or max(result[dim]["output"],
                                               result[dim]["rows"]) > 1e-5:
            failures.append(f"dim {dim}: {result[dim]}")
    return {"dims": result, "failures": failures}


class Recorder:
    """Prints each part's result and appends it to ``out.jsonl`` as it comes."""

    def __init__(self, out: str) -> None:
        self.out, self.records = out, []
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        open(out + ".jsonl", "w").close()

    def run(self, part: str, fn: Callable[[], Dict], **labels) -> None:
        try:
            record = dict(part=part, **labels, **fn())
        except Exception:  # noqa: BLE001 - recorded, and the exit code says so
            record = dict(part=part, **labels, failures=[traceback.format_exc()[-3000:]])
        record["ok"] = not record["failures"]
        self.records.append(record)
        line = json.dumps(record, default=str)
        print(line, flush=True)
        with open(self.out + ".jsonl", "a") as f:
            f.write(line + "\n")

    def close(self, meta: Dict) -> bool:
        with open(self.out + ".json", "w") as f:
            json.dump({"meta": meta, "records": self.records}, f, indent=1, default=str)
        return all(r["ok"] for r in self.records)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lookups", type=int, default=65536)
    p.add_argument("--num-ids", type=int, default=1 << 18)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--replays", type=int, default=8)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--wide-dims", type=int, nargs="+", default=[1536, 1537, 4096, MAX_DIM])
    p.add_argument("--emulated", action="store_true",
                   help="on the CPU: the CUDA path emulated, the graph stand-in")
    p.add_argument("--out", default="benchmark/out/gpu/steps")
    args = p.parse_args()
    recorder = Recorder(args.out)
    with accelerator(args.emulated) as acc:
        meta = {"device": acc.name(), "torch": torch.__version__, "argv": sys.argv[1:]}
        print(json.dumps(meta), flush=True)
        for part in ("syncs", "graph"):
            if part not in args.parts:
                continue
            fn = syncs_part if part == "syncs" else graph_part
            for layout in args.layouts:
                for optimizer in args.optimizers:
                    recorder.run(part, lambda: fn(acc, layout, optimizer, args),
                                 layout=layout, optimizer=optimizer)
        if "wide_dims" in args.parts:
            recorder.run("wide_dims", lambda: wide_dims_part(acc, args.wide_dims))
    return 0 if recorder.close(meta) else 1


if __name__ == "__main__":
    sys.exit(main())
