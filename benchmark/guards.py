"""The CPU speed guards: every ratio the project promises, measured side by side
with its baseline in one process and printed against its goal.

Each guard times its subject and its baseline alternately (subject, baseline,
subject, ...), so that the machine's noise of the moment falls on both, and takes
the per-repetition ratios: the printed ratio is their median, the noise their
interquartile range. A guard fails when even its favourable quartile (the lower
one) is past its goal: a ratio past the goal by more than its noise. Exit status 1
when any guard fails.

- P1 ``find`` + gather / plain gather of the same rows: a table of 1M slots at load
  0.75, dim 128, batch 65,536 ids present.
- P2 a training step (forward, backward, fused optimizer) / FBGEMM's CPU TBE with the
  same optimizer: batch 65,536, 1M ids (power law 1.05), dim 128, SGD and row-wise
  Adagrad; Adam against ``nn.EmbeddingBag(sparse=True)`` + ``SparseAdam`` (FBGEMM's
  CPU table has no Adam).
- P3 the training step with a device cache of 10% of the touched ids / all rows
  resident (SGD, the P2 batches).
- P4 a 2-rank ``EmbeddingCollection`` with dedup (gloo) / TorchRec's static tables
  with the same dedup (``benchmark_embedding_collection.py``, a short run).
- P5 the CUDA step's host syncs and kernel launches, counted on CPU under the
  emulation (``benchmark_step_overhead.py``): 0 syncs; at most 20 launches of the
  step's own with all rows on the device, 30 with a 10% cache. ``P5 cpu``: the same
  counts, with the same goals, of the CPU backend's own step (its host reads of
  tensor values; its launches: the extension's calls and the aten ops).

Example::

    bash benchmark/guards.sh            # every guard, about a minute on 2 cores
    python benchmark/guards.py --only P2 --reps 21
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Callable, List, NamedTuple, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import benchmark_batched_dynamicemb_tables as tables_bench  # noqa: E402
import benchmark_hash_table as hash_bench  # noqa: E402


class Verdict(NamedTuple):
    """One guard's outcome: its ratio (median of the paired ratios), the quartiles
    that bound its noise, and its goal (the most the ratio may be)."""

    name: str
    what: str
    ratio: float
    low: float
    high: float
    goal: float

    @property
    def failed(self) -> bool:
        return self.low > self.goal

    def line(self) -> str:
        mark = "FAIL" if self.failed else ("ok" if self.ratio <= self.goal else "ok (noise)")
        return (f"{self.name:<15} {self.ratio:8.3f}  [{self.low:.3f}, {self.high:.3f}]  "
                f"goal <= {self.goal:<6g} {mark:<10} {self.what}")


def verdict(name: str, what: str, ratios: List[float], goal: float) -> Verdict:
    """The median and quartiles of ``ratios`` against ``goal``."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return Verdict(name, what, round(statistics.median(ratios), 3), round(q[0], 3),
                   round(q[2], 3), goal)


def paired_ratios(subject: Callable[[int], None], baseline: Callable[[int], None], reps: int,
                  warmup: int = 2) -> List[float]:
    """subject(i) / baseline(i) times over ``reps`` alternated repetitions (the order
    inside a pair alternates too: neither side always runs on a cache the other
    warmed)."""
    ratios = []
    for i in range(warmup + reps):
        pair = [subject, baseline] if i % 2 == 0 else [baseline, subject]
        spent = {}
        for fn in pair:
            start = time.perf_counter()
            fn(i)
            spent[fn] = time.perf_counter() - start
        if i >= warmup:
            ratios.append(spent[subject] / spent[baseline])
    return ratios


# ----------------------------------------------------------------- P1
def guard_find_gather(reps: int) -> List[Verdict]:
    table = hash_bench.prefilled_table(1 << 20, 128, 0.75, seed=128, device=torch.device("cpu"))
    present = table.export_batch().keys
    gen = torch.Generator().manual_seed(1)
    keys = present[torch.randint(0, present.numel(), (65536,), generator=gen)]
    slots = table.find(keys)
    out = torch.empty(keys.numel(), 128)
    ratios = paired_ratios(
        lambda i: torch.index_select(table.values, 0, table.find(keys), out=out),
        lambda i: torch.index_select(table.values, 0, slots, out=out), reps * 2)
    return [verdict("P1", "find+gather / gather, load 0.75, dim 128, 65,536 ids", ratios, 1.3)]


# ----------------------------------------------------------------- P2, P3
def _bench_args(reps: int) -> SimpleNamespace:
    return SimpleNamespace(embedding_dim=128, num_features=1, pooling_factor=1, alpha=1.05,
                           num_iterations=reps, warmup=2, distinct_batches=8)


def _trainer(module: torch.nn.Module, batches, grad: torch.Tensor,
             after: Optional[Callable[[], None]] = None) -> Callable[[int], None]:
    def train(i: int) -> None:
        indices, offsets = batches[i % len(batches)]
        module(indices, offsets).backward(grad)
        if after is not None:
            after()
    return train


def _sparse_adam(num_embeddings: int, dim: int):
    """PyTorch's own sparse Adam table: the CPU baseline where FBGEMM has none."""
    bag = torch.nn.EmbeddingBag(num_embeddings, dim, mode="sum", sparse=True,
                                include_last_offset=True)  # FBGEMM's B + 1 offsets
    optimizer = torch.optim.SparseAdam(bag.parameters(), lr=0.01)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return bag, step


def guard_training(reps: int, optimizers: List[str]) -> List[Verdict]:
    args = _bench_args(reps)
    num_embeddings, batch = 1 << 20, 65536
    batches = tables_bench.make_batches(args, batch, num_embeddings)
    grad = torch.randn(batch, args.embedding_dim, generator=torch.Generator().manual_seed(2))
    found = []
    for optimizer in optimizers:
        ours = tables_bench.make_dynamicemb(args, num_embeddings, optimizer)
        theirs, after, name = tables_bench.make_torchrec(args, num_embeddings, optimizer), None, "FBGEMM CPU TBE"
        if theirs is None:
            theirs, after = _sparse_adam(num_embeddings, args.embedding_dim)
            name = "nn.EmbeddingBag + SparseAdam"
        ratios = paired_ratios(_trainer(ours, batches, grad), _trainer(theirs, batches, grad, after),
                               reps)
        found.append(verdict(f"P2 {optimizer}", f"train step / {name}, batch 65,536, 1M ids, dim 128",
                             ratios, 0.55))
        del ours, theirs
    if "sgd" in optimizers:
        touched = torch.cat([ids for ids, _ in batches]).unique().numel()
        cached = tables_bench.make_dynamicemb(args, num_embeddings, "sgd", max(16, touched // 10))
        resident = tables_bench.make_dynamicemb(args, num_embeddings, "sgd")
        ratios = paired_ratios(_trainer(cached, batches, grad), _trainer(resident, batches, grad), reps)
        found.append(verdict("P3", "train step, 10% device cache / all resident (SGD)", ratios, 1.3))
    return found


# ----------------------------------------------------------------- P4
def guard_collection(iterations: int) -> List[Verdict]:
    """The EmbeddingCollection benchmark on 2 gloo ranks, dedup on: the dynamic table's
    step over TorchRec's, per iteration (the two are stepped in turn)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ec")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(HERE, "benchmark_embedding_collection.py"), "--use_index_dedup", "true",
               "--use_dynamic_embedding", "both", "--batch_size", "2048", "--warmup", "2",
               "--iterations", str(iterations), "--out", out]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise RuntimeError(f"benchmark_embedding_collection.py failed ({run.returncode}):\n"
                               f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        with open(out + ".json") as f:
            rows = {r["table"]: r["ms_per_iteration_all"] for r in json.load(f)["rows"]}
    ratios = [a / b for a, b in zip(rows["dynamic"], rows["torchrec"])]
    return [verdict("P4", "2-rank EmbeddingCollection with dedup / TorchRec's, batch 2,048/rank",
                    ratios, 0.75)]


# ----------------------------------------------------------------- P5
def _loss_launches() -> int:
    """The launches of the counted step's loss (``out.sum().backward()``) alone."""
    from dynamicemb_testing.sync_guard import SyncGuard
    out = torch.zeros(8, 4, requires_grad=True)
    with SyncGuard() as guard:
        (out * 1.0).sum().backward()
    return guard.launches() - 1  # the mul stands for the module's output


def guard_step_counts() -> List[Verdict]:
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "test"))
    import benchmark_step_overhead as overhead

    args = SimpleNamespace(dim=128, num_ids=100_000, count_lookups=4096)
    loss = _loss_launches()
    found = []
    for backend, prefix, step, how in (("cuda_emulated", "P5", "CUDA", "(emulated)"),
                                       ("cpu", "P5 cpu", "CPU", "(the CPU backend's own)")):
        for cache, budget in ((False, 20), (True, 30)):
            counts = overhead.count_step(args, cache, backend)
            own = counts["aten_launches"] + counts["kernel_launches"] - loss
            where = "10% cache" if cache else "all rows on the device"
            suffix = " c" if cache else ""
            found.append(verdict(f"{prefix} syncs{suffix}",
                                 f"host syncs of a steady {step} step, {where} {how}",
                                 [counts["syncs"]], 0))
            found.append(verdict(f"{prefix} launch{suffix}",
                                 f"kernel launches of the step's own, {where} {how}", [own],
                                 budget))
    return found


GUARDS = ("P1", "P2", "P3", "P4", "P5")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=GUARDS, default=list(GUARDS))
    parser.add_argument("--reps", type=int, default=21, help="timed pairs per guard")
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "rowwise_adagrad", "adam"],
                        choices=["sgd", "rowwise_adagrad", "adam"])
    parser.add_argument("--out", default=None, help="write the verdicts as JSON here")
    args = parser.parse_args()
    tables_bench.same_allocator_for_all()
    verdicts: List[Verdict] = []
    started = time.perf_counter()
    if "P1" in args.only:
        verdicts += guard_find_gather(args.reps)
    if "P2" in args.only or "P3" in args.only:
        optimizers = args.optimizers if "P2" in args.only else ["sgd"]
        found = guard_training(args.reps, optimizers)
        verdicts += [v for v in found if v.name.split()[0] in args.only]
    if "P4" in args.only:
        verdicts += guard_collection(max(args.reps, 5))
    if "P5" in args.only:
        verdicts += guard_step_counts()
    print(f"\nguard           ratio    [quartiles]      goal         verdict    what "
          f"({torch.get_num_threads()} threads, {time.perf_counter() - started:.0f} s)")
    for v in verdicts:
        print(v.line())
    if args.out:
        with open(args.out, "w") as f:
            json.dump([v._asdict() | {"failed": v.failed} for v in verdicts], f, indent=1)
    failed = [v.name for v in verdicts if v.failed]
    if failed:
        print(f"\nFAILED: {', '.join(failed)} past the goal by more than the noise")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
