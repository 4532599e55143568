"""Sharded EmbeddingCollection: TorchRec's static tables vs one dynamic table, with
and without id dedup before the all-to-all, in one run (``torchrun``, gloo on CPU).

Reproduces the upstream table "Benchmark EmbeddingCollection" (dedup on/off x
TorchRec raw table / dynamic table, ms per training iteration). The model is the
26 Criteo categorical features (HugeCTR's Criteo table sizes), multi-hot, dim 128:

- TorchRec column: 26 static tables (FUSED kernel, FBGEMM TBE), row-wise.
- dynamic column: the 26 features fused into one dynamic table (feature ``i`` uses
  ids ``offset_i + id``), row-wise, capacity = the sum of the 26 sizes.

``--collection ebc`` runs the same tables as an EmbeddingBagCollection (SUM pooling):
TorchRec has no EBC dedup, so its column is the same in both rows; the dynamic
column with dedup sends unique ids and pools returned rows on the sender.

Both use SGD. Dedup on uses ``DynamicEmbeddingCollectionSharder(use_index_dedup=True)``
for both columns: TorchRec's own EC dedup calls ``fbgemm::jagged_unique_indices``,
which has no CPU kernel. Ids of feature ``i`` are ``floor(size_i * u**3)`` with
``u ~ U(0, 1)`` (skewed toward small ids, so batches repeat ids). Every iteration
steps the four modules in turn (interleaved, same batch), so noise falls on all of
them alike; each cell is the median over iterations of the slowest rank. After the
timed iterations one step of each module runs under ``torch.profiler`` to count the
collectives it issues (reported per cell).

Each rank uses the cores it may run on divided among the ranks that share them
(``dynamicemb.shard.threads_per_rank``), not among ``LOCAL_WORLD_SIZE``: several
torchrun agents on one machine would otherwise each take every core. The sharding
plans read the node size as TorchRec does (``get_local_size``).

Example::

    # one node
    torchrun --standalone --nproc_per_node 2 benchmark/benchmark_embedding_collection.py --batch_size 8192
    # two nodes (run on each, NODE_RANK 0 and 1; MASTER_ADDR: node 0's address)
    torchrun --nnodes 2 --node_rank NODE_RANK --nproc_per_node 1 --master_addr MASTER_ADDR \
        --master_port 29500 benchmark/benchmark_embedding_collection.py --batch_size 8192
"""

import argparse
import math
import platform
import statistics
import time
from collections import Counter
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from _report import write_report

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.plan import to_sharding_plan
from dynamicemb.planner import DynamicEmbParameterConstraints, to_dynamic_sharding
from dynamicemb.shard import (DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder,
                              host_ranks, threads_per_rank)

CRITEO_SIZES = [203931, 18598, 14092, 7012, 18977, 4, 6385, 1245, 49, 186213, 71328, 67288, 11,
                2168, 7338, 61, 4, 932, 15, 204515, 141526, 199433, 60919, 9137, 71, 34]
FEATURES = [f"cat_{i}" for i in range(len(CRITEO_SIZES))]
DEDUP = {"on": True, "off": False}
KINDS = ["torchrec", "dynamic"]


class Model(nn.Module):
    def __init__(self, collection: nn.Module) -> None:
        super().__init__()
        self.ec = collection

    def forward(self, features: KeyedJaggedTensor):
        return self.ec(features)


def build(kind: str, dedup: bool, dim: int, world_size: int, collection: str = "ec",
          plan_file: Optional[str] = None) -> DistributedModelParallel:
    meta = torch.device("meta")
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}
    if collection == "ec":
        sharder, config, module = DynamicEmbeddingCollectionSharder, EmbeddingConfig, EmbeddingCollection
    else:
        sharder, config, module = DynamicEmbeddingBagCollectionSharder, EmbeddingBagConfig, EmbeddingBagCollection
    sharder = sharder(fused_params=fused, use_index_dedup=dedup)
    if kind == "torchrec":
        tables = [config(name=f"t_{f}", num_embeddings=n, embedding_dim=dim, feature_names=[f])
                  for f, n in zip(FEATURES, CRITEO_SIZES)]
    else:
        tables = [config(name="criteo", num_embeddings=sum(CRITEO_SIZES), embedding_dim=dim,
                         feature_names=FEATURES)]
    ec = module(tables=tables, device=meta)
    options = DynamicEmbTableOptions(dim=dim, max_capacity=sum(CRITEO_SIZES))
    if plan_file is not None:  # lookups: the 26 features in order (cat_0 .. cat_25)
        constraints = ({"criteo": DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=options)}
                       if kind == "dynamic" else None)
        model = Model(ec)
        plan = to_sharding_plan(plan_file, model, constraints=constraints, sharders=[sharder],
                                local_world_size=get_local_size(world_size))
        return DistributedModelParallel(model, plan=plan, sharders=[sharder], device=torch.device("cpu"))
    plan = construct_module_sharding_plan(ec, {t.name: row_wise(compute_kernel="fused") for t in tables},
                                          sharder=sharder, local_size=get_local_size(world_size),
                                          world_size=world_size, device_type="cpu")
    if kind == "dynamic":
        plan["criteo"] = to_dynamic_sharding(plan["criteo"], options)
    return DistributedModelParallel(Model(ec), plan=ShardingPlan({"ec": plan}), sharders=[sharder],
                                    device=torch.device("cpu"))


def make_batch(batch_size: int, hotness: int, generator: torch.Generator, fused_ids: bool) -> KeyedJaggedTensor:
    """``hotness`` ids per sample and feature; dynamic: feature i's ids shifted by offset_i."""
    sizes = torch.tensor(CRITEO_SIZES, dtype=torch.float64)
    u = torch.rand(len(FEATURES), batch_size * hotness, generator=generator, dtype=torch.float64)
    ids = (sizes[:, None] * u ** 3).long().clamp_max_((sizes - 1).long()[:, None])
    if fused_ids:
        offsets = torch.tensor([0] + CRITEO_SIZES[:-1]).cumsum(0)
        ids = ids + offsets[:, None]
    lengths = torch.full((len(FEATURES) * batch_size,), hotness, dtype=torch.int64)
    return KeyedJaggedTensor(keys=FEATURES, values=ids.reshape(-1), lengths=lengths)


def step(dmp: DistributedModelParallel, batch: KeyedJaggedTensor, pooled: bool) -> None:
    """Forward, backward and the fused optimizer's step."""
    out = dmp(batch)
    if pooled:  # EBC: a KeyedTensor
        loss = out.values().sum()
    else:
        loss = sum(out[f].values().sum() for f in FEATURES)
    loss.backward()
    dmp.fused_optimizer.step()


def train_step(dmp: DistributedModelParallel, batch: KeyedJaggedTensor, pooled: bool) -> float:
    """ms of one ``step`` on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    step(dmp, batch, pooled)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) * 1e3


def count_collectives(dmp: DistributedModelParallel, batch: KeyedJaggedTensor, pooled: bool) -> Dict[str, int]:
    """The collectives one ``step`` issues on this rank (``c10d::`` ops by name), and
    ``all_to_all_elements``: the elements this rank's all-to-alls sent."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(dmp, batch, pooled)
    events = [e for e in prof.events() if e.name.startswith("c10d::")]
    counts = dict(Counter(e.name for e in events))
    # c10d::alltoall_base_(output, input, splits...): the input's shape
    counts["all_to_all_elements"] = sum(
        math.prod(e.input_shapes[1]) for e in events if e.name == "c10d::alltoall_base_")
    return counts


def parse_choice(value: str) -> List[str]:
    value = value.lower()
    if value in ("both", "all"):
        return ["on", "off"]
    return ["on"] if value in ("true", "1", "on", "yes") else ["off"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--use_index_dedup", default="both", help="true, false or both")
    parser.add_argument("--use_dynamic_embedding", default="both",
                        help="true (dynamic column only), false (TorchRec column only) or both")
    parser.add_argument("--batch_size", type=int, default=8192, help="per rank")
    parser.add_argument("--collection", choices=["ec", "ebc"], default="ec",
                        help="EmbeddingCollection (sequence) or EmbeddingBagCollection (SUM pooled)")
    parser.add_argument("--hotness", type=int, default=2, help="ids per sample and feature")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per rank (default: this machine's cores / its ranks)")
    parser.add_argument("--out", default=None,
                        help="output prefix (default benchmark/out/embedding_collection or ..._bag_collection)")
    parser.add_argument("--plan-file", dest="plan_file", default=None,
                        help="HugeCTR plan file (lookups: cat_0..cat_25) used instead of row-wise "
                             "everywhere; the dynamic model's one table needs one placement for all")
    args = parser.parse_args()
    if args.out is None:
        args.out = "benchmark/out/" + ("embedding_collection" if args.collection == "ec" else "embedding_bag_collection")
    return args


def layout() -> Dict[str, int]:
    """How the ranks are spread: TorchRec's nodes and this machine's share (collective)."""
    world_size = dist.get_world_size()
    local = get_local_size(world_size)
    return {"world_size": world_size, "local_world_size": local, "nodes": world_size // local,
            "ranks_on_this_machine": len(host_ranks())}


def run_cells(args, models: Dict[tuple, DistributedModelParallel], rank: int) -> Dict[tuple, List[float]]:
    """Steps every module on the same batches (interleaved); ms per timed iteration."""
    generator = torch.Generator().manual_seed(1234 + rank)
    times: Dict[tuple, List[float]] = {cell: [] for cell in models}
    for it in range(args.warmup + args.iterations):
        state = generator.get_state()
        for cell, dmp in models.items():
            generator.set_state(state)  # the same ids for every module
            batch = make_batch(args.batch_size, args.hotness, generator, fused_ids=cell[1] == "dynamic")
            elapsed = train_step(dmp, batch, args.collection == "ebc")
            if it >= args.warmup:
                times[cell].append(elapsed)
    return times


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads or threads_per_rank())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spread = layout()
    dynamic_choice = parse_choice(args.use_dynamic_embedding)
    kinds = [k for k, choice in zip(KINDS, ["off", "on"]) if choice in dynamic_choice]
    cells = [(d, k) for d in parse_choice(args.use_index_dedup) for k in kinds]
    models = {cell: build(cell[1], DEDUP[cell[0]], args.dim, world_size, args.collection, args.plan_file)
              for cell in cells}
    times = run_cells(args, models, rank)
    ids_sent: Dict[tuple, int] = {}
    collectives: Dict[tuple, Dict[str, int]] = {}
    generator = torch.Generator().manual_seed(4321 + rank)
    for cell, dmp in models.items():
        counters = dmp.module.ec.id_counters
        ids_sent[cell] = int(sum(int(s.sum()) for s in counters.sent.values()))
        batch = make_batch(args.batch_size, args.hotness, generator, fused_ids=cell[1] == "dynamic")
        collectives[cell] = count_collectives(dmp, batch, args.collection == "ebc")
    if rank == 0:
        report(args, spread, cells, times, ids_sent, collectives)
    dist.destroy_process_group()


def report(args, spread: Dict[str, int], cells, times, ids_sent, collectives) -> None:
    rows = [{"use_index_dedup": DEDUP[d], "table": k, "ms_per_iteration": statistics.median(times[(d, k)]),
             "ms_per_iteration_all": [round(t, 3) for t in times[(d, k)]],
             "ids_sent_by_rank0_all_iterations": ids_sent[(d, k)],
             "collectives_per_iteration_rank0": collectives[(d, k)]} for d, k in cells]
    world_size = spread["world_size"]
    meta = {"collection": args.collection, **spread, "backend": "gloo", "device": "cpu",
            "batch_size_per_rank": args.batch_size, "hotness": args.hotness, "dim": args.dim,
            "features": len(FEATURES), "iterations": args.iterations, "warmup": args.warmup,
            "threads_per_rank": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.machine(), "processor": platform.processor()}
    by_cell = {(r["use_index_dedup"], r["table"]): r["ms_per_iteration"] for r in rows}
    name = "EmbeddingCollection" if args.collection == "ec" else "EmbeddingBagCollection (SUM)"
    lines = [f"{name}, {world_size} ranks on {spread['nodes']} node(s) (gloo, CPU, "
             f"{torch.get_num_threads()} threads/rank), batch {args.batch_size}/rank, "
             f"26 features x {args.hotness} ids, dim {args.dim}, SGD; ms per training iteration (median)", "",
             "| use_index_dedup | TorchRec raw table | dynamic table |", "|---|---|---|"]
    for d in ("on", "off"):
        if any((DEDUP[d], k) in by_cell for k in KINDS):
            cols = [f"{by_cell[(DEDUP[d], k)]:.1f}" if (DEDUP[d], k) in by_cell else "-" for k in KINDS]
            lines.append(f"| {DEDUP[d]} | " + " | ".join(cols) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_report(args.out, meta, rows, table)
    print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
    main()
