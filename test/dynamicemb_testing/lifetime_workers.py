"""Rank body of the sharded TTL test (spawned; importable, no pytest here)."""

from typing import Dict, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dynamicemb
from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbScoreStrategy, DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingCollectionSharder, get_dynamic_tables
from dynamicemb_testing.shard_workers import EcModel

CPU = torch.device("cpu")
TABLE_OF = {"f": "rw", "g": "rw", "h": "tw"}  # "rw" row-wise over all ranks, "tw" table-wise
FEATURES = list(TABLE_OF)
GLOBAL_BATCH, TTL = 8, 2
#: step -> id range: the first ids go quiet after step 2, come back at step 7.
ID_RANGES = {1: (0, 40), 2: (0, 40), 3: (100, 140), 4: (100, 140), 5: (100, 140),
             6: (100, 140), 7: (0, 40)}


def build(world_size: int) -> DistributedModelParallel:
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name=n, num_embeddings=512, embedding_dim=4,
                        feature_names=[f for f, t in TABLE_OF.items() if t == n])
        for n in ("rw", "tw")], device=torch.device("meta"))
    sharder = DynamicEmbeddingCollectionSharder(
        fused_params={"optimizer": "exact_sgd", "learning_rate": 0.1})
    plan = construct_module_sharding_plan(
        ec, {"rw": row_wise(compute_kernel="fused"),
             "tw": table_wise(rank=world_size - 1, compute_kernel="fused")},
        sharder=sharder, local_size=get_local_size(world_size), world_size=world_size,
        device_type="cpu")
    for name in ("rw", "tw"):
        plan[name] = to_dynamic_sharding(plan[name], DynamicEmbTableOptions(
            dim=4, max_capacity=512, bucket_capacity=16, ttl=TTL,
            score_strategy=DynamicEmbScoreStrategy.STEP,
            initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1)))
    return DistributedModelParallel(EcModel(ec), plan=ShardingPlan({"ec": plan}),
                                    sharders=[sharder], device=CPU)


def global_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lengths (features, batch), ids) of the global batch of ``step``."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(FEATURES), GLOBAL_BATCH), generator=g)
    lo, hi = ID_RANGES[step]
    return lengths, torch.randint(lo, hi, (int(lengths.sum()),), generator=g)


def local_kjt(step: int, rank: int, world_size: int) -> KeyedJaggedTensor:
    lengths, ids = global_batch(step)
    per = GLOBAL_BATCH // world_size
    bags = list(torch.split(ids, lengths.flatten().tolist()))
    mine = [bags[f * GLOBAL_BATCH + b] for f in range(len(FEATURES))
            for b in range(rank * per, (rank + 1) * per)]
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(mine),
                             lengths=lengths[:, rank * per:(rank + 1) * per].flatten())


def _gather(kjt: KeyedJaggedTensor, out) -> Dict[str, Tuple[list, torch.Tensor]]:
    """Every rank's (ids, output rows) per feature, in rank order."""
    local = {f: (kjt[f].values().tolist(), out[f].values().detach()) for f in FEATURES}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return {f: (sum((g[f][0] for g in gathered), []), torch.cat([g[f][1] for g in gathered]))
            for f in FEATURES}


def _alive(last: Dict[tuple, int], step: int) -> set:
    return {p for p, s in last.items() if step - s <= TTL}


def ttl_under_dmp(rank: int, world_size: int) -> None:
    """Rows expire on every sharding; a sweep on one rank only needs no collective;
    an expired key is looked up as its first, initial row again."""
    dmp = build(world_size)
    tables = get_dynamic_tables(dmp)
    initial: Dict[tuple, torch.Tensor] = {}  # (table, key) -> row at its first lookup
    last: Dict[tuple, int] = {}  # the model: last training step of each (table, key)
    for step in sorted(ID_RANGES):
        kjt = local_kjt(step, rank, world_size)
        out = dmp(kjt)
        seen = _gather(kjt, out)
        for f, (ids, rows) in seen.items():
            for key, row in zip(ids, rows):
                p = (TABLE_OF[f], key)
                if p not in last or step - last[p] > TTL:  # new or expired: the initial row
                    torch.testing.assert_close(row, initial.setdefault(p, row), rtol=0, atol=0)
        for f, (ids, _) in seen.items():
            for key in ids:
                last[(TABLE_OF[f], key)] = step
        sum(out[f].values().sum() for f in FEATURES).backward()
        if step == 6:
            # every rank holds only alive rows (expired ones are never exported)
            mine = {(n, k) for n, m in tables.items() for k in m.export_keys_values(n).keys.tolist()}
            everyone = [None] * world_size
            dist.all_gather_object(everyone, mine)
            assert set().union(*everyone) == _alive(last, step)
            if rank == 0:  # rank 0 sweeps, rank 1 does not: no collective in the sweep
                freed = dynamicemb.expire(dmp)
                assert set(freed) == set(tables) and sum(freed.values()) > 0
    freed = dynamicemb.expire(dmp)  # both ranks at the end
    sizes = [None] * world_size
    dist.all_gather_object(sizes, {n: m.table_size(n) for n, m in tables.items()})
    alive = _alive(last, max(ID_RANGES))
    for name in ("rw", "tw"):
        assert sum(s.get(name, 0) for s in sizes) == sum(1 for t, _ in alive if t == name)
    assert all(m.cache_metrics()[n].expired > 0 for n, m in tables.items()), freed
