"""The CPU speed guards: every ratio the project promises, measured side by side
with its baseline in one process and printed against its goal.

Each guard times its subject and its baseline alternately, in pairs whose order
alternates (A B | B A | A B ...), so that the machine's noise of the moment falls on
both, and takes one ratio per round of two pairs, the subject's two times over the
baseline's (each side once right after itself and once after the other:
``paired_ratios``): the printed ratio is their median, the noise their
interquartile range. A guard fails when even its favourable quartile (the lower
one) is past its goal: a ratio past the goal by more than its noise. Exit status 1
when any guard fails.

- P1 ``find`` + gather / plain gather of the same rows: a table of 1M slots at load
  0.75, dim 128, batch 65,536 ids present.
- P2 a training step (forward, backward, fused optimizer) / FBGEMM's CPU TBE with the
  same optimizer: batch 65,536, 1M ids (power law 1.05), dim 128, SGD, Adagrad and
  row-wise Adagrad (goal 0.6); Adam against ``nn.EmbeddingBag(sparse=True)`` +
  ``SparseAdam`` (FBGEMM's CPU table has no Adam; goal 0.4). Each optimizer is also
  paired against FBGEMM's fastest optimizer on this machine (``P2 <opt> fastest``,
  reported: which of FBGEMM's JIT kernels wins depends on the CPU).
- P2 fwd / P2 eval: the training forward and the eval lookup (SGD tables) / FBGEMM's
  (goal 0.9).
- P2 floor: the SGD step / the time the bytes it must move (unique rows read twice
  and written once, the output written, the gradient read) take at the machine's
  copy bandwidth, measured here (goal 1.6).
- P3 the training step with a device cache of 10% of the touched ids / all rows
  resident (SGD, the P2 batches).
- P4 a 2-rank ``EmbeddingCollection`` with dedup (gloo) / TorchRec's static tables
  with the same dedup (``benchmark_embedding_collection.py``, a short run).
- P6 a training step of bfloat16 and float16 rows (SGD, row-wise Adagrad) / FBGEMM's
  CPU TBE with FP16 weights (goal 0.5), and / our float32 step (goal 1.0).
- P5 the CUDA step's host syncs and kernel launches, counted on CPU under the
  emulation (``benchmark_step_overhead.py``): 0 syncs; at most 20 launches of the
  step's own with all rows on the device, 30 with a 10% cache. ``P5 cpu``: the same
  counts, with the same goals, of the CPU backend's own step (its host reads of
  tensor values; its launches: the extension's calls and the aten ops).

The first lines name the CPU, its vector extensions and the copy of the CPU kernels
this process loaded: a ratio belongs to a machine kind.

Example::

    bash benchmark/guards.sh            # every guard, a few minutes on 2 cores
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
    that bound its noise, and its goal (the most the ratio may be; None: reported
    only)."""

    name: str
    what: str
    ratio: float
    low: float
    high: float
    goal: Optional[float]

    @property
    def failed(self) -> bool:
        return self.goal is not None and self.low > self.goal

    def line(self) -> str:
        if self.goal is None:
            mark, goal = "info", "-"
        else:
            mark = "FAIL" if self.failed else ("ok" if self.ratio <= self.goal else "ok (noise)")
            goal = f"{self.goal:g}"
        return (f"{self.name:<24} {self.ratio:8.3f}  [{self.low:.3f}, {self.high:.3f}]  "
                f"goal <= {goal:<6} {mark:<10} {self.what}")


def verdict(name: str, what: str, ratios: List[float], goal: Optional[float]) -> Verdict:
    """The median and quartiles of ``ratios`` against ``goal``."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return Verdict(name, what, round(statistics.median(ratios), 3), round(q[0], 3),
                   round(q[2], 3), goal)


def machine() -> str:
    """The CPU model, its vector extensions that matter here, and the kernel copy loaded."""
    from dynamicemb.ops import cpu_kernels
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni")
    return (f"CPU: {model} ({' '.join(f for f in wanted if f in flags) or 'no AVX'}); "
            f"kernels: {cpu_kernels.load().__name__}; {torch.get_num_threads()} threads")


def paired_ratios(subject: Callable[[int], None], baseline: Callable[[int], None], reps: int,
                  warmup: int = 2) -> List[float]:
    """subject / baseline over ``reps`` alternated pairs, one ratio per round of two.

    The order inside a pair alternates (subject first, then baseline first: the calls
    run A B | B A | A B ...), so the side that runs first in a pair ran last in the
    pair before, on caches it warmed itself, and the other side after it. One pair's
    ratio is biased by that: the 16-bit steps against float32's read 0.95 with the
    subject first and 1.12 with it second, and the median of such a two-humped list
    moved from run to run across the goal. A round is two pairs, one in each order,
    and its ratio is the subject's two times over the baseline's: each side once warm
    and once after the other. ``reps`` pairs give ``reps // 2`` rounds (at least one).
    """
    ratios = []
    rounds = max(1, reps // 2)
    mine = theirs = 0.0
    for i in range(warmup + 2 * rounds):
        pair = [subject, baseline] if i % 2 == 0 else [baseline, subject]
        spent = {}
        for fn in pair:
            start = time.perf_counter()
            fn(i)
            spent[fn] = time.perf_counter() - start
        if i < warmup:
            continue
        mine, theirs = mine + spent[subject], theirs + spent[baseline]
        if (i - warmup) % 2 == 1:
            ratios.append(mine / theirs)
            mine = theirs = 0.0
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


TRAIN_GOALS = {"sgd": 0.6, "adagrad": 0.6, "rowwise_adagrad": 0.6, "adam": 0.4}
FBGEMM_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def _times(fn: Callable[[int], None], reps: int, warmup: int = 2) -> List[float]:
    """Seconds of fn(i) over ``reps`` calls after ``warmup``."""
    spent = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        fn(i)
        if i >= warmup:
            spent.append(time.perf_counter() - start)
    return spent


def _fastest_fbgemm(args, num_embeddings: int, batches, grad: torch.Tensor, reps: int):
    """FBGEMM's optimizer whose training step is fastest here, and its table."""
    medians = {}
    for optimizer in FBGEMM_OPTIMIZERS:
        module = tables_bench.make_torchrec(args, num_embeddings, optimizer)
        medians[optimizer] = statistics.median(_times(_trainer(module, batches, grad), reps))
        del module
    best = min(medians, key=medians.get)
    return best, tables_bench.make_torchrec(args, num_embeddings, best)


def _copy_bandwidth() -> float:
    """Bytes per second that a 256 MiB tensor copy moves (read + write), its fastest
    of 15: the floor is what the machine can do (on the 2-core VM the second thread
    is there in some copies only, and the rate then doubles)."""
    src = torch.ones(1 << 26)
    dst = torch.empty_like(src)
    seconds = min(_times(lambda i: dst.copy_(src), 15))
    return 2 * src.numel() * src.element_size() / seconds


def _lookups(module: torch.nn.Module, batches, evaluate: bool) -> Callable[[int], None]:
    """A forward of ``module`` per call: the training forward, or eval under no_grad."""
    def lookup(i: int) -> None:
        indices, offsets = batches[i % len(batches)]
        module.train(not evaluate)
        with torch.set_grad_enabled(not evaluate):
            module(indices, offsets)
        module.train()
    return lookup


def _forward_and_floor(args, batches, grad, ours, theirs, reps: int) -> List[Verdict]:
    """P2 fwd, P2 eval (SGD tables against FBGEMM's) and P2 floor (the SGD step)."""
    found = []
    for name, evaluate in (("fwd", False), ("eval", True)):
        ratios = paired_ratios(_lookups(ours, batches, evaluate),
                               _lookups(theirs, batches, evaluate), reps)
        found.append(verdict(f"P2 {name}", f"{'eval lookup' if evaluate else 'training forward'}"
                             " / FBGEMM CPU TBE's, batch 65,536, dim 128", ratios, 0.9))
    lookups = batches[0][0].numel()
    unique = statistics.mean(ids.unique().numel() for ids, _ in batches)
    row = args.embedding_dim * 4
    must_move = 3 * unique * row + 2 * lookups * row  # rows read twice, written once; out; grad
    floor = must_move / _copy_bandwidth()
    ratios = [t / floor for t in _times(_trainer(ours, batches, grad), reps)]
    found.append(verdict("P2 floor", f"SGD train step / {must_move / 1e6:.0f} MB at the measured "
                         f"copy bandwidth ({floor * 1e3:.2f} ms)", ratios, 1.6))
    return found


def guard_training(reps: int, optimizers: List[str]) -> List[Verdict]:
    args = _bench_args(reps)
    num_embeddings, batch = 1 << 20, 65536
    batches = tables_bench.make_batches(args, batch, num_embeddings)
    grad = torch.randn(batch, args.embedding_dim, generator=torch.Generator().manual_seed(2))
    fastest_name, fastest = _fastest_fbgemm(args, num_embeddings, batches, grad, 5)
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
                             ratios, TRAIN_GOALS[optimizer]))
        ratios = paired_ratios(_trainer(ours, batches, grad), _trainer(fastest, batches, grad), reps)
        found.append(verdict(f"P2 {optimizer} fastest",
                             f"train step / FBGEMM's fastest here ({fastest_name})", ratios, None))
        if optimizer == "sgd":
            found += _forward_and_floor(args, batches, grad, ours, theirs, reps)
        del ours, theirs
    del fastest
    if "sgd" in optimizers:
        touched = torch.cat([ids for ids, _ in batches]).unique().numel()
        cached = tables_bench.make_dynamicemb(args, num_embeddings, "sgd", max(16, touched // 10))
        resident = tables_bench.make_dynamicemb(args, num_embeddings, "sgd")
        ratios = paired_ratios(_trainer(cached, batches, grad), _trainer(resident, batches, grad), reps)
        found.append(verdict("P3", "train step, 10% device cache / all resident (SGD)", ratios, 1.3))
    return found


# ----------------------------------------------------------------- P6
HALF_OPTIMIZERS = ("sgd", "rowwise_adagrad")


def guard_sixteen_bit(reps: int) -> List[Verdict]:
    """P6: training steps of bfloat16 and float16 rows (stochastic rounding) against
    FBGEMM's CPU TBE with FP16 weights (its stochastic rounding, the default; goal 0.5)
    and against our own float32 step (goal 1.0), the P2 batches."""
    args = _bench_args(reps)
    num_embeddings, batch = 1 << 20, 65536
    batches = tables_bench.make_batches(args, batch, num_embeddings)
    grad = torch.randn(batch, args.embedding_dim, generator=torch.Generator().manual_seed(2))
    found = []
    for optimizer in HALF_OPTIMIZERS:
        theirs = tables_bench.make_torchrec(args, num_embeddings, optimizer, "FP16")
        full = tables_bench.make_dynamicemb(args, num_embeddings, optimizer)
        for dtype in (torch.bfloat16, torch.float16):
            ours = tables_bench.make_dynamicemb(args, num_embeddings, optimizer, dtype=dtype)
            name = f"P6 {optimizer} {str(dtype)[6:]}"
            ratios = paired_ratios(_trainer(ours, batches, grad), _trainer(theirs, batches, grad),
                                   reps)
            found.append(verdict(name, "train step / FBGEMM CPU TBE with FP16 rows, batch "
                                 "65,536, 1M ids, dim 128", ratios, 0.5))
            ratios = paired_ratios(_trainer(ours, batches, grad), _trainer(full, batches, grad),
                                   reps)
            found.append(verdict(f"{name} / f32", "train step / our float32 rows' step",
                                 ratios, 1.0))
            del ours
        del theirs, full
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


GUARDS = ("P1", "P2", "P3", "P4", "P5", "P6")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=GUARDS, default=list(GUARDS))
    parser.add_argument("--reps", type=int, default=21,
                        help="timed pairs per guard (ratios: one per round of two pairs)")
    parser.add_argument("--optimizers", nargs="+", default=list(TRAIN_GOALS),
                        choices=list(TRAIN_GOALS))
    parser.add_argument("--out", default=None, help="write the verdicts as JSON here")
    args = parser.parse_args()
    tables_bench.same_allocator_for_all()
    verdicts: List[Verdict] = []
    print(machine(), flush=True)
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
    if "P6" in args.only:
        verdicts += guard_sixteen_bit(args.reps)
    print(f"\n{'guard':<24} ratio    [quartiles]      goal         verdict    what "
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
