"""Rank bodies of the multi-node tests, run by ``torchrun`` agents (one per node):

    python -m torch.distributed.run --nnodes N --node_rank I ... \\
        -m dynamicemb_testing.multinode_workers CHECK [CHECK ...]

Each check reads the layout from the environment torchrun sets (``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) and fails if the code under test assumes one
node. A failing check raises, the rank exits non-zero and its agent fails.
"""

import math
import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.plan import to_sharding_plan
from dynamicemb.plan.generators import distributed
from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints, dynamic_table_bytes
from dynamicemb.shard import (DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder,
                              host_ranks, threads_per_rank)
from dynamicemb_testing import dedup_workers, shard_workers


def _layout() -> Dict[str, int]:
    """What torchrun told this rank (the truth the code must agree with)."""
    env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")}
    assert env["WORLD_SIZE"] == dist.get_world_size() and env["RANK"] == dist.get_rank(), env
    return env


def topology(rank: int, world_size: int) -> None:
    """TorchRec, the planner and the thread helper see the launched layout: nodes of
    LOCAL_WORLD_SIZE ranks for sharding, every rank of this machine for cores."""
    env = _layout()
    local = env["LOCAL_WORLD_SIZE"]
    assert local < world_size, "the test must launch several nodes"
    assert get_local_size(world_size) == local
    assert env["GROUP_RANK"] == rank // local  # torchrun numbers nodes in rank blocks
    planner = DynamicEmbeddingShardingPlanner(constraints=_constraints())
    assert (planner._topology.world_size, planner._topology.local_world_size) == (world_size, local)
    assert host_ranks() == list(range(world_size))  # all "nodes" run on this machine
    assert threads_per_rank() == max(1, len(os.sched_getaffinity(0)) // world_size)


# name -> (rows, sharding type or None for a static table)
PLANNED = {"p_rw": (1 << 14, "row_wise"), "p_tw": (3000, "table_wise"), "p_static": (500, None)}
DIM = 8


class _Planned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=n, num_embeddings=rows, embedding_dim=DIM, feature_names=[f"f_{n}"])
            for n, (rows, _) in PLANNED.items()], device=torch.device("meta"))


def _constraints() -> Dict[str, ParameterConstraints]:
    return {n: (ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"]) if st is None
                else DynamicEmbParameterConstraints(use_dynamicemb=True, sharding_types=[st],
                                                    dynamicemb_options=DynamicEmbTableOptions()))
            for n, (_, st) in PLANNED.items()}


def _native_io_bytes(world_size: int, local: int) -> Dict[tuple, int]:
    """(table, shard index) -> what TorchRec's own planner charges a shard beyond
    its dense weight (input and output buffers), for the same tables all static."""
    constraints = {n: ParameterConstraints(sharding_types=[st or "row_wise"], compute_kernels=["fused"])
                   for n, (_, st) in PLANNED.items()}
    native = EmbeddingShardingPlanner(Topology(world_size=world_size, local_world_size=local, compute_device="cpu"),
                                      batch_size=64, constraints=constraints)
    native.plan(_Planned(), [EmbeddingCollectionSharder()])
    return {(o.name, i): s.storage.ddr - s.size[0] * s.size[1] * 4
            for o in native._best_plan for i, s in enumerate(o.shards)}


def _node_charges(best_plan, io: Dict[tuple, int], world_size: int, local: int):
    """(charged, expected) bytes per node: a dynamic shard costs its hash table
    (``dynamic_table_bytes`` at its rows) plus TorchRec's buffers, a static one its
    dense weight plus the buffers."""
    charged = [0] * (world_size // local)
    expected = [0] * (world_size // local)
    for option in best_plan:
        rows, st = PLANNED[option.name]
        for i, shard in enumerate(option.shards):
            assert shard.size[0] == (rows if st == "table_wise" else math.ceil(rows / world_size))
            table = (sum(dynamic_table_bytes(DynamicEmbTableOptions(dim=DIM, max_capacity=rows), shard.size[0]))
                     if st else shard.size[0] * DIM * 4)
            charged[shard.rank // local] += shard.storage.ddr
            expected[shard.rank // local] += table + io[(option.name, i)]
    return charged, expected


def planner_memory(rank: int, world_size: int) -> None:
    """The default planner (topology from the process group) charges each node its
    own ranks' shares of the dynamic tables: a row-wise table one share per rank, a
    table-wise table all on the owner's node; every rank gets rank 0's plan, the
    plan of a planner given the topology explicitly."""
    local = _layout()["LOCAL_WORLD_SIZE"]
    sharders = [DynamicEmbeddingCollectionSharder(), DynamicEmbeddingBagCollectionSharder()]
    planner = DynamicEmbeddingShardingPlanner(batch_size=64, constraints=_constraints())
    plan = planner.plan(_Planned(), sharders)
    assert planner.collective_plan(_Planned(), sharders) == plan
    explicit = DynamicEmbeddingShardingPlanner(
        Topology(world_size=world_size, local_world_size=local, compute_device="cpu"),
        batch_size=64, constraints=_constraints())
    assert explicit.plan(_Planned(), sharders) == plan
    charged, expected = _node_charges(planner._best_plan, _native_io_bytes(world_size, local), world_size, local)
    assert charged == expected, (charged, expected)
    owner = plan.plan["ec"]["p_tw"].ranks[0] // local
    whole = sum(dynamic_table_bytes(DynamicEmbTableOptions(dim=DIM, max_capacity=3000), 3000))
    assert all(charged[owner] - charged[n] >= whole for n in range(len(charged)) if n != owner), charged


def plan_file_devices(rank: int, world_size: int) -> None:
    """A plan file translated on a multi-node job puts CUDA shards on device
    ``rank % LOCAL_WORLD_SIZE`` (each node's own GPUs), without being told."""
    local = _layout()["LOCAL_WORLD_SIZE"]
    model = _Planned()
    lookups = [f"f_{n}" for n in PLANNED]
    plan = to_sharding_plan(distributed([rows for rows, _ in PLANNED.values()], world_size), model,
                            lookups=lookups, device="cuda")
    devices = {}
    for sharding in plan.plan["ec"].values():
        for shard in sharding.sharding_spec.shards:
            devices[shard.placement.rank()] = shard.placement.device()
    assert devices, "the plan places no shard"
    for shard_rank, device in devices.items():
        assert device == torch.device("cuda", shard_rank % local), (shard_rank, device)


def twins(rank: int, world_size: int) -> None:
    """Drop-in equality with dedup on: dynamic EC and EBC tables against the same
    tables as native TorchRec ones (outputs, losses, rows after training)."""
    shard_workers.twin_models(rank, world_size, "sgd", 4, True)
    dedup_workers.dedup_twin(rank, world_size, False, dedup_workers.SUM_TABLES, True, 4)


def digest(rank: int, world_size: int) -> None:
    """Trains a dynamic EC with dedup a few steps and prints a digest of its outputs
    and owner rows: the same job on two networks prints the same digest."""
    import hashlib  # noqa: PLC0415
    from dynamicemb.shard import get_dynamic_tables  # noqa: PLC0415
    from dynamicemb_testing.replica_workers import OPTIMIZERS, _step, build  # noqa: PLC0415
    dmp = build(world_size, OPTIMIZERS["sgd"], False)
    h = hashlib.sha256()
    for step in range(3):
        for v in _step(dmp, step, rank).values():
            h.update(v.detach().numpy().tobytes())
    for name, module in sorted(get_dynamic_tables(dmp).items()):
        rows = module.export_keys_values(name)
        order = torch.argsort(rows.keys)
        h.update(rows.keys[order].numpy().tobytes() + rows.embeddings[order].numpy().tobytes())
    print(f"rank {rank}: digest {h.hexdigest()}", flush=True)


def fail_on_last_node(rank: int, world_size: int) -> None:
    """Fails on the last node's ranks after a collective (for the launcher's test)."""
    dist.barrier()
    if int(os.environ["GROUP_RANK"]) == world_size // get_local_size(world_size) - 1:
        raise AssertionError(f"rank {rank} fails on purpose")


CHECKS = {f.__name__: f for f in (topology, planner_memory, plan_file_devices, twins, digest,
                                  fail_on_last_node)}


def main(names: List[str]) -> None:
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise SystemExit(f"usage: {sys.argv[0]} CHECK...; checks: {sorted(CHECKS)}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for name in names:
        CHECKS[name](rank, world_size)
        print(f"rank {rank}: {name} passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
