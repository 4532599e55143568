"""BatchedDynamicEmbeddingTables on a GPU beside a static PyTorch embedding, in one run.

The rows of the upstream "Benchmark BatchedDynamicEmbeddingTables" table without
caching (``benchmark/benchmark_batched_dynamicemb_tables.py`` is the CPU driver,
whose static column is FBGEMM's CPU kernel): one table of ``num_embeddings``
rows, dim 128, a batch of ``batch_size`` single-id bags with power-law ids (alpha
1.05). The static column is ``torch.nn.EmbeddingBag(sparse=True)`` with the same
optimizer (SGD; Adam as ``torch.optim.SparseAdam``), the best static table this
machine has without FBGEMM's CUDA build; both hold every row before timing.

``--hbm_gib`` adds the seed's caching rows: with that many GiB of device memory for
value rows, ``cache`` (an HBM cache over the host store, whose rows are in pinned host
memory) and ``in-place`` (rows beyond the budget read and updated in host memory, no
promotion), each timed beside the same static table (one dynamic layout built at a
time), with the cache's hit rate.

``--graphed`` adds the all-HBM table (and with ``--hbm_gib`` the cache) with its
training step (forward, backward and fused optimizer) captured once in a CUDA graph
and replayed with each batch copied into the graph's static ids (its ``train`` only:
the graph is the whole step). ``--layouts`` picks layouts by kind instead (``all-hbm``,
``all-hbm-graphed``, ``cache``, ``in-place``, ``cache-graphed``).

Per iteration, each module in turn (so noise falls on both alike): ``forward``
(training forward), ``backward`` (backward with the optimizer step), ``train``
(both), ``eval`` (no-grad forward in eval mode), each wall-clock between device
synchronizations, reported as medians in ms, with the paired train ratio.

One dynamic layout exists at a time: each is built, timed and freed before the
next (the static table, warmed by one step so that its optimizer state exists,
stays). Each row records the bytes the process holds after the row against those
it held before the first layout (reachable tensors; on a GPU also PyTorch's
allocated memory); more than ``--leak_slack_mib`` beyond is a leak, and the exit
code is 1 after every row ran. Rows are printed and appended to ``--out``.jsonl as
they come; ``--out``.json and .md hold them all at the end. ``--emulated`` runs it
on the CPU at tiny sizes (the CUDA path emulated, the graph stand-in;
``_accelerator.py``).

Example::

    python benchmark/benchmark_gpu_tables.py --batch_sizes 65536 1048576 \\
        --num_embeddings 8388608 67108864 --optimizers sgd adam
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from _accelerator import Accelerator, accelerator
from _report import write_report

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions

OPTIMIZERS = {"sgd": DynamicEmbOptimType.EXACT_SGD, "adam": DynamicEmbOptimType.ADAM}
LAYOUT_KINDS = ("all-hbm", "all-hbm-graphed", "cache", "in-place", "cache-graphed")
LR = 0.01


def power_law_ids(n: int, num_embeddings: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """(n,) ids in [0, num_embeddings) with P(k) ~ (k + 1)^-alpha (inverse CDF)."""
    u = torch.rand(n, generator=gen, dtype=torch.float64, device=gen.device)
    a = 1.0 - alpha
    x = ((float(num_embeddings + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return (x.floor().long() - 1).clamp_(0, num_embeddings - 1)


class Static(torch.nn.Module):
    """nn.EmbeddingBag with a sparse gradient and its optimizer, stepped in backward."""

    def __init__(self, num_embeddings: int, dim: int, optimizer: str, device) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(num_embeddings, dim, mode="sum", sparse=True,
                                         device=device)
        params = list(self.bag.parameters())
        self.opt = (torch.optim.SGD(params, lr=LR) if optimizer == "sgd"
                    else torch.optim.SparseAdam(params, lr=LR))

    def forward(self, ids, offsets):
        return self.bag(ids, offsets[:-1])

    def step(self, out, grad):
        out.backward(grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Dynamic(torch.nn.Module):
    """One dynamic table holding every id (pre-filled), its optimizer fused; with
    ``hbm_bytes``, that device budget as a cache (``caching``) or placed rows."""

    def __init__(self, num_embeddings: int, dim: int, optimizer: str, device,
                 hbm_bytes=None, caching: bool = False) -> None:
        super().__init__()
        options = DynamicEmbTableOptions(dim=dim, max_capacity=num_embeddings,
                                         init_capacity=num_embeddings, caching=caching,
                                         local_hbm_for_values=hbm_bytes)
        self.tables = BatchedDynamicEmbeddingTables(
            [options], optimizer=OPTIMIZERS[optimizer], learning_rate=LR, device=device)
        chunk = 1 << 22
        for start in range(0, num_embeddings, chunk):
            keys = torch.arange(start, min(num_embeddings, start + chunk), device=device)
            self.tables.import_keys_values(
                "t0", keys, torch.randn(keys.numel(), dim, device=device) * 0.01)

    def forward(self, ids, offsets):
        return self.tables(ids, offsets)

    def step(self, out, grad):
        out.backward(grad)


class Graphed(torch.nn.Module):
    """A ``Dynamic`` whose training step is one CUDA graph (PyTorch's recipe: warm up
    on a side stream, capture, then copy each batch into the static inputs and
    replay)."""

    def __init__(self, acc: Accelerator, dynamic: Dynamic, ids: torch.Tensor,
                 offsets: torch.Tensor, grad: torch.Tensor) -> None:
        super().__init__()
        self.dynamic = dynamic
        self.tables = dynamic.tables
        self.ids, self.offsets, self.grad = ids.clone(), offsets.clone(), grad
        with acc.side_stream():
            for _ in range(3):
                dynamic(self.ids, self.offsets).backward(grad)
        self.graph, _ = acc.capture(
            lambda: dynamic(self.ids, self.offsets).backward(grad))

    def replay_step(self, ids, offsets) -> None:
        self.ids.copy_(ids)
        self.offsets.copy_(offsets)
        self.graph.replay()

    def forward(self, ids, offsets):
        return self.dynamic(ids, offsets)


def timed(fn: Callable[[], object], acc: Accelerator) -> float:
    acc.synchronize()
    start = time.perf_counter()
    fn()
    acc.synchronize()
    return (time.perf_counter() - start) * 1e3


def time_pair(modules: Dict[str, torch.nn.Module], batches, grad, iterations: int,
              warmup: int, acc: Accelerator) -> Dict[str, Dict[str, List[float]]]:
    times = {name: {"forward": [], "backward": [], "train": [], "eval": []} for name in modules}
    for it in range(warmup + iterations):
        ids, offsets = batches[it % len(batches)]
        for name, m in modules.items():
            m.train()
            if hasattr(m, "replay_step"):  # the whole step is one graph
                train = timed(lambda: m.replay_step(ids, offsets), acc)
                if it >= warmup:
                    times[name]["train"].append(train)
                continue
            holder = {}
            fwd = timed(lambda: holder.setdefault("out", m(ids, offsets)), acc)
            bwd = timed(lambda: m.step(holder["out"], grad), acc)
            m.eval()
            with torch.no_grad():
                ev = timed(lambda: m(ids, offsets), acc)
            if it >= warmup:
                for phase, t in (("forward", fwd), ("backward", bwd), ("train", fwd + bwd),
                                 ("eval", ev)):
                    times[name][phase].append(t)
    return times


def layouts(args) -> List[tuple]:
    """(name, device bytes or None, caching, graphed) of each dynamic layout to time:
    ``--layouts`` if given, else what ``--skip_all_hbm``, ``--hbm_gib`` and
    ``--graphed`` ask for."""
    kinds = args.layouts
    if kinds is None:
        kinds = [] if args.skip_all_hbm else ["all-hbm"]
        if args.graphed and not args.skip_all_hbm:
            kinds.append("all-hbm-graphed")
        if args.hbm_gib:
            kinds += ["cache", "in-place"] + (["cache-graphed"] if args.graphed else [])
    out = []
    if "all-hbm" in kinds:
        out.append(("all-hbm", None, False, False))
    if "all-hbm-graphed" in kinds:
        out.append(("all-hbm, CUDA graph", None, False, True))
    for gib in args.hbm_gib:
        budget = int(gib * 2**30)
        for kind, name, caching, graphed in (
                ("cache", f"cache {gib:g} GiB", True, False),
                ("in-place", f"in-place {gib:g} GiB", False, False),
                ("cache-graphed", f"cache {gib:g} GiB, CUDA graph", True, True)):
            if kind in kinds:
                out.append((name, budget, caching, graphed))
    if not out:
        raise SystemExit(f"no layout to time: --layouts {kinds} (cache kinds need --hbm_gib)")
    return out


def time_layout(args, acc: Accelerator, static: Static, batches, grad, layout: tuple,
                num_embeddings: int, optimizer: str) -> Dict:
    """Builds one dynamic layout, times it beside ``static`` and returns its row; the
    layout is freed when this returns (nothing of it escapes)."""
    name, hbm_bytes, caching, graphed = layout
    dynamic = Dynamic(num_embeddings, args.embedding_dim, optimizer, acc.device, hbm_bytes,
                      caching)
    if graphed:
        dynamic = Graphed(acc, dynamic, *batches[0], grad)
    modules = {"static": static, "dynamicemb": dynamic}
    times = time_pair(modules, batches, grad, args.num_iterations, args.warmup, acc)
    row = {"layout": name}
    for module_name in modules:
        for phase, ts in times[module_name].items():
            row[f"{phase}({module_name})"] = round(statistics.median(ts), 4) if ts else None
    pairs = [d / s for d, s in zip(times["dynamicemb"]["train"], times["static"]["train"])]
    row["train ratio (paired)"] = round(statistics.median(pairs), 3)
    metrics = dynamic.tables.cache_metrics()["t0"]
    row["cache hit rate"] = round(metrics.hit_rate, 4) if caching else None
    return row


def leaked(held: Dict[str, int], before: Dict[str, int], slack: int) -> Dict[str, int]:
    """The kinds of held bytes that grew by more than ``slack`` since ``before``."""
    return {k: held[k] - before[k] for k in held if held[k] - before[k] > slack}


def run_config(args, acc: Accelerator, batch: int, num_embeddings: int,
               optimizer: str, jsonl: Optional[str] = None) -> List[Dict]:
    gen = torch.Generator(acc.device).manual_seed(0)
    offsets = torch.arange(batch + 1, device=acc.device)
    batches = [(power_law_ids(batch, num_embeddings, args.alpha, gen), offsets)
               for _ in range(args.distinct_batches)]
    grad = torch.randn(batch, args.embedding_dim, generator=gen, device=acc.device)
    static = Static(num_embeddings, args.embedding_dim, optimizer, acc.device)
    static.step(static(*batches[0]), grad)  # its optimizer state exists from here on
    before = acc.held_bytes()
    slack = int(args.leak_slack_mib * 2**20)
    rows = []
    for layout in layouts(args):
        row = {"batch_size": batch, "num_embeddings": num_embeddings, "optimizer": optimizer,
               "embedding_dim": args.embedding_dim, "alpha": args.alpha,
               "iterations": args.num_iterations}
        row.update(time_layout(args, acc, static, batches, grad, layout, num_embeddings,
                               optimizer))
        held = acc.held_bytes()  # after a collection: only what outlives the layout
        row["held_bytes_before"] = before
        row["held_bytes_after"] = held
        row["leaked_bytes"] = leaked(held, before, slack)
        rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(line + "\n")
    del static
    gc.collect()
    return rows


def markdown(rows: List[Dict]) -> str:
    skip = ("held_bytes_before", "held_bytes_after", "leaked_bytes")
    cols = [c for c in rows[0] if c not in skip]
    return ("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + "".join(
        "| " + " | ".join(str(r[c]) for c in cols) + " |\n" for r in rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[65536])
    parser.add_argument("--num_embeddings", type=int, nargs="+", default=[1 << 23])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam"], choices=OPTIMIZERS)
    parser.add_argument("--embedding_dim", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--num_iterations", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--distinct_batches", type=int, default=8)
    parser.add_argument("--hbm_gib", type=float, nargs="*", default=[],
                        help="device GiB for value rows: adds a cache and an in-place row each")
    parser.add_argument("--skip_all_hbm", action="store_true",
                        help="time only the --hbm_gib layouts")
    parser.add_argument("--graphed", action="store_true",
                        help="add the all-HBM table with its step replayed from a CUDA graph")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUT_KINDS, default=None,
                        help="the layouts to time (instead of the three flags above)")
    parser.add_argument("--leak_slack_mib", type=float, default=64.0,
                        help="held bytes a row may add before it counts as a leak")
    parser.add_argument("--emulated", action="store_true",
                        help="on the CPU: the CUDA path emulated, the graph stand-in")
    parser.add_argument("--out", default="benchmark/out/gpu_tables")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    jsonl = args.out + ".jsonl"
    open(jsonl, "w").close()
    rows = []
    with accelerator(args.emulated) as acc:
        for n in args.num_embeddings:
            for batch in args.batch_sizes:
                for opt in args.optimizers:
                    rows += run_config(args, acc, batch, n, opt, jsonl)
        meta = {"device": acc.name(), "torch": torch.__version__, "unit": "ms, median",
                "argv": sys.argv[1:]}
    table = markdown(rows)
    write_report(args.out, meta, rows, table)
    print(f"\n{json.dumps(meta)}\n\n{table}")
    leaks = [(r["layout"], r["leaked_bytes"]) for r in rows if r["leaked_bytes"]]
    if leaks:
        print(f"leak: bytes held after a row beyond the slack: {leaks}", file=sys.stderr)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
