"""Rank bodies of the sharded checkpoint tests (spawned; importable, no pytest here)."""

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import (DynamicEmbDump, DynamicEmbInitializerArgs, DynamicEmbLoad,
                        DynamicEmbTableOptions, FrequencyAdmissionStrategy)
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingCollectionSharder, get_dynamic_tables
from dynamicemb.checkpoint.tables import shard_kernels
from dynamicemb_testing.shard_workers import EcModel

CPU = torch.device("cpu")
# name -> (dim, features); "rw" is row-wise (or table-wise on rank 0), "tw" table-wise
# on the last rank.
TABLES = {"rw": (8, ["f", "g"]), "tw": (8, ["h"])}
FEATURES = ["f", "g", "h"]
GLOBAL_BATCH = 8
ROWS = 512


def build(world_size: int, optimizer: str = "adam", rw_kind: str = "row_wise",
          caching: bool = False, external: Optional[str] = None) -> DistributedModelParallel:
    """The EC model sharded over ``world_size`` ranks; "rw" row-wise or table-wise;
    with ``external`` (a directory) "rw" keeps 128 rows per rank in host memory and
    the rest in RocksDB there."""
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name=n, num_embeddings=ROWS, embedding_dim=d, feature_names=f)
        for n, (d, f) in TABLES.items()], device=torch.device("meta"))
    fused = {"optimizer": optimizer, "learning_rate": 0.05, "eps": 1e-8}
    sharder = DynamicEmbeddingCollectionSharder(fused_params=fused)
    rw = row_wise(compute_kernel="fused") if rw_kind == "row_wise" else table_wise(
        rank=0, compute_kernel="fused")
    plan = construct_module_sharding_plan(
        ec, {"rw": rw, "tw": table_wise(rank=world_size - 1, compute_kernel="fused")},
        sharder=sharder, local_size=get_local_size(world_size), world_size=world_size, device_type="cpu")
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1)
    budget = 16 * 4 * 3 * 8 if caching else None
    plan["rw"] = to_dynamic_sharding(plan["rw"], DynamicEmbTableOptions(
        dim=8, max_capacity=ROWS, initializer_args=init, caching=caching,
        local_hbm_for_values=budget, admit_strategy=FrequencyAdmissionStrategy(threshold=2),
        external_storage=external,
        local_host_for_values=None if external is None else 128 * (8 + 16) * 4))
    plan["tw"] = to_dynamic_sharding(plan["tw"], DynamicEmbTableOptions(
        dim=8, max_capacity=ROWS, initializer_args=init))
    return DistributedModelParallel(EcModel(ec), plan=ShardingPlan({"ec": plan}),
                                    sharders=[sharder], device=CPU)


def local_batch(step: int, rank: int, world_size: int) -> KeyedJaggedTensor:
    """This rank's slice of the global batch of ``step`` (same global batch for any W)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(FEATURES), GLOBAL_BATCH), generator=g)
    values = [torch.randint(0, 200, (int(n),), generator=g) for n in lengths.flatten()]
    per = GLOBAL_BATCH // world_size
    mine = slice(rank * per, (rank + 1) * per)
    lens = lengths[:, mine]
    vals = [values[f * GLOBAL_BATCH + b] for f in range(len(FEATURES))
            for b in range(GLOBAL_BATCH)[mine]]
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(vals), lengths=lens.flatten())


def train(dmp, steps, rank: int, world_size: int) -> List[Dict[str, torch.Tensor]]:
    """Trains; returns each step's global outputs per feature. The loss is scaled by
    the world size (TorchRec divides model-parallel gradients by it), so the
    updates do not depend on the number of ranks."""
    outs = []
    for step in steps:
        out = dmp(local_batch(step, rank, world_size))
        loss = sum(((out[f].values() - 0.25) ** 2).sum() for f in FEATURES) * world_size
        loss.backward()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, {f: out[f].values().detach() for f in FEATURES})
        outs.append({f: torch.cat([g[f] for g in gathered]) for f in FEATURES})
    return outs


def global_state(dmp, names=tuple(TABLES)) -> Dict[str, tuple]:
    """Every rank's rows and counters of each table, gathered and sorted by key."""
    tables = get_dynamic_tables(dmp)
    local = {}
    for name in names:
        if name in tables:
            module = tables[name]
            local[name] = (tuple(module.export_keys_values(name)),
                           tuple(module.export_admission_counters(name)))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    state = {}
    for name in names:
        parts = [g[name] for g in gathered if name in g]
        rows = [torch.cat([p[0][i] for p in parts]) for i in range(4)]
        counters = [torch.cat([p[1][i] for p in parts]) for i in range(3)]
        order, corder = rows[0].argsort(), counters[0].argsort()
        state[name] = ([t[order] for t in rows], [t[corder] for t in counters])
    return state


def assert_states_close(a, b, exact: bool) -> None:
    for name in TABLES:
        (rows_a, counters_a), (rows_b, counters_b) = a[name], b[name]
        # An admission counter's score is its rank's counter clock, which ticks only in
        # batches with waiting keys on that rank: comparable at equal placements only.
        fields = rows_a + counters_a if exact else rows_a + counters_a[:2]
        for i, (x, y) in enumerate(zip(fields, rows_b + counters_b)):
            if exact or x.dtype == torch.int64:  # keys and row scores are always exact
                assert torch.equal(x, y), (name, i)
            else:
                torch.testing.assert_close(x, y, msg=lambda m: f"{name} field {i}: {m}")


def save_then_continue(rank: int, world_size: int, ckpt: str, record: str, rw_kind: str) -> None:
    """10 steps, dump, then 5 more: the uninterrupted run, recorded for the loaders."""
    dmp = build(world_size, rw_kind=rw_kind)
    train(dmp, range(10), rank, world_size)
    DynamicEmbDump(ckpt, dmp)
    outs = train(dmp, range(10, 15), rank, world_size)
    state = global_state(dmp)
    if rank == 0:
        torch.save({"outs": outs, "state": state}, record)


def load_then_continue(rank: int, world_size: int, ckpt: str, record: str, rw_kinds: List[str],
                       exact: bool, external: Optional[str] = None) -> None:
    """Loads into another world size / sharding (with ``external``: "rw" over RocksDB
    in that directory); 5 steps equal the uninterrupted run."""
    for rw_kind in rw_kinds:
        where = None if external is None else f"{external}/{world_size}-{rw_kind}"
        _load_then_continue(rank, world_size, ckpt, record, rw_kind, exact, where)


def _load_then_continue(rank: int, world_size: int, ckpt: str, record: str, rw_kind: str,
                        exact: bool, external: Optional[str] = None) -> None:
    dmp = build(world_size, rw_kind=rw_kind, external=external)
    train(dmp, range(3), rank, world_size)  # other contents first: the load replaces them
    DynamicEmbLoad(ckpt, dmp)
    tables = get_dynamic_tables(dmp)
    for name, module in tables.items():  # each rank holds only rows it owns
        keys = module.export_keys_values(name).keys
        kernel = next(k for n, k in shard_kernels(dmp) if n == name)
        assert bool(kernel.owns(name, keys).all()), name
    outs = train(dmp, range(10, 15), rank, world_size)
    expected = torch.load(record)
    for got, want in zip(outs, expected["outs"]):
        for f in FEATURES:
            if exact:
                assert torch.equal(got[f], want[f]), f
            else:
                torch.testing.assert_close(got[f], want[f])
    assert_states_close(global_state(dmp), expected["state"], exact)


def sharded_round_trip(rank: int, world_size: int, directory: str) -> None:
    """Every optimizer, cache on and off (the full grid runs unsharded): a load into an equal model restores each
    rank's rows, states, scores, counters and clocks exactly."""
    for optimizer, caching in (("exact_sgd", False), ("adam", True), ("exact_adagrad", True),
                               ("exact_row_wise_adagrad", False), ("adam", False)):
        path = os.path.join(directory, f"{optimizer}-{caching}")
        saved = build(world_size, optimizer, caching=caching)
        train(saved, range(4), rank, world_size)
        DynamicEmbDump(path, saved)
        loaded = build(world_size, optimizer, caching=caching)
        DynamicEmbLoad(path, loaded)
        mine, theirs = get_dynamic_tables(saved), get_dynamic_tables(loaded)
        assert sorted(mine) == sorted(theirs)
        for name, module in mine.items():
            other = theirs[name]
            assert module.table_clocks(name) == other.table_clocks(name)
            assert module.train_steps == other.train_steps
            for a, b in zip(module.export_keys_values(name), other.export_keys_values(name)):
                oa = module.export_keys_values(name).keys.argsort()
                ob = other.export_keys_values(name).keys.argsort()
                assert torch.equal(a[oa], b[ob]), (optimizer, caching, name)
        outs_a = train(saved, range(4, 6), rank, world_size)
        outs_b = train(loaded, range(4, 6), rank, world_size)
        for x, y in zip(outs_a, outs_b):
            for f in FEATURES:
                assert torch.equal(x[f], y[f])


def incremental_dump_gathers_every_rank(rank: int, world_size: int) -> None:
    """A module's ``incremental_dump(pg=...)`` (upstream's member) returns every rank's
    rows touched since the threshold, in rank order, and the lowest next score."""
    from dynamicemb import BatchedDynamicEmbeddingTablesV2, DynamicEmbTableOptions

    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=3)
    module = BatchedDynamicEmbeddingTablesV2(
        [DynamicEmbTableOptions(dim=4, max_capacity=256, initializer_args=init)],
        table_names=["t"], pooling_mode=2, learning_rate=0.1)
    ids = torch.tensor([10 * rank + 1, 10 * rank + 2])
    module(ids, torch.arange(ids.numel() + 1)).sum().backward()
    rows, next_scores = module.incremental_dump({"t": 0}, pg=dist.group.WORLD)
    want = [10 * r + k for r in range(world_size) for k in (1, 2)]
    keys, embeddings = rows["t"]
    assert sorted(keys.tolist()[2 * rank: 2 * rank + 2]) == [10 * rank + 1, 10 * rank + 2]
    assert sorted(keys.tolist()) == want and embeddings.shape == (len(want), 4)
    mine = module.export_keys_values("t")
    for key, row in zip(keys.tolist(), embeddings):
        if key in mine.keys.tolist():
            assert torch.equal(row, mine.embeddings[mine.keys.tolist().index(key)])
    every = [None] * world_size
    dist.all_gather_object(every, module.next_score("t"))
    assert next_scores == {"t": min(every)}
