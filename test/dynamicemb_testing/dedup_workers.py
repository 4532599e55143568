"""Rank bodies of the EBC row-wise id-dedup tests (spawned; importable, no pytest here)."""

from typing import Dict, List, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, import_dense_rows, owner_rank
from dynamicemb.shard.rw_dedup_sharding import DynamicEmbRwDedupInputDist
from dynamicemb_testing.shard_workers import all_rows, full_dense

CPU = torch.device("cpu")
BATCH = 4
# name -> (num_embeddings, dim, features, sharding type, pooling)
SUM_TABLES = {"d_rw1": (64, 8, ["e", "f"], "row_wise", PoolingType.SUM),
              "d_rw2": (48, 8, ["g"], "row_wise", PoolingType.SUM),
              "d_tw": (40, 4, ["h"], "table_wise", PoolingType.SUM)}
# TorchRec 1.8 divides every non-row-wise feature by its length once a row-wise table
# is MEAN (the plugin does not; see ARCHITECTURE.md), so the native twin of a row-wise
# MEAN table has row-wise tables only
MEAN_TABLES = {"d_rw1": (64, 8, ["e", "f"], "row_wise", PoolingType.SUM),
               "d_rw2": (48, 8, ["g"], "row_wise", PoolingType.MEAN)}
# (weighted, tables, use_index_dedup)
VARIANTS = [(False, SUM_TABLES, True), (True, SUM_TABLES, True), (False, MEAN_TABLES, True),
            (True, SUM_TABLES, False)]


def _features(tables: Dict) -> List[str]:
    return [f for _, _, fs, _, _ in tables.values() for f in fs]


class _Model(nn.Module):
    def __init__(self, weighted: bool, tables: Dict) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f, pooling=p)
            for n, (r, d, f, _, p) in tables.items()], is_weighted=weighted, device=torch.device("meta"))

    def forward(self, features: KeyedJaggedTensor):
        return self.ebc(features)


def _build(world_size: int, weighted: bool, tables: Dict, dynamic: bool, use_index_dedup: bool = True):
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    model = _Model(weighted, tables)
    sharder = (DynamicEmbeddingBagCollectionSharder(fused_params=fused, use_index_dedup=use_index_dedup) if dynamic
               else EmbeddingBagCollectionSharder(fused_params=fused))
    helpers = {n: (table_wise(rank=world_size - 1, compute_kernel="fused") if st == "table_wise"
                   else row_wise(compute_kernel="fused")) for n, (_, _, _, st, _) in tables.items()}
    plan = construct_module_sharding_plan(model.ebc, helpers, sharder=sharder, local_size=get_local_size(world_size),
                                          world_size=world_size, device_type="cpu")
    if dynamic:
        for n, (r, d, _, _, _) in tables.items():
            plan[n] = to_dynamic_sharding(plan[n], DynamicEmbTableOptions(dim=d, max_capacity=r))
    return DistributedModelParallel(model, plan=ShardingPlan({"ebc": plan}), sharders=[sharder], device=CPU)


def _batch(step: int, rank: int, weighted: bool, features: List[str]) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(31 * step + rank)
    lengths = torch.randint(0, 5, (len(features) * BATCH,), generator=g)
    if step == 3 and rank == 1:  # a rank with no ids at all
        lengths.zero_()
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=g)  # many repeats
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=features, values=values, lengths=lengths, weights=weights)


def _loss(pooled: torch.Tensor) -> torch.Tensor:
    scale = torch.arange(1, pooled.shape[1] + 1, dtype=torch.float32) / pooled.shape[1]
    return ((pooled * scale - 0.25) ** 2).sum()


def _key(name: str) -> str:
    return f"ebc.embedding_bags.{name}.weight"


def _check_id_counters(dmp, features: KeyedJaggedTensor, tables: Dict, world_size: int,
                       dedup: bool) -> Tuple[int, int]:
    """One batch's ``id_counters``: row-wise tables send their unique ids (all ids
    without dedup) to each id's owner, table-wise ones every id to the table's rank.
    Returns (ids sent, ids given) of the row-wise tables."""
    ebc = dmp.module.ebc
    dists = [d for d in ebc._input_dists if isinstance(d, DynamicEmbRwDedupInputDist)]
    assert len(dists) == int(dedup), "row-wise dynamic tables take the dedup path iff it is on"
    per_key = features.to_dict()
    totals = [0, 0]
    for name, (_, _, names, st, _) in tables.items():
        values = torch.cat([per_key[f].values() for f in names])
        assert ebc.id_counters.before_dedup[name] == values.numel(), name
        if st == "table_wise":
            expected = torch.zeros(world_size, dtype=torch.int64)
            expected[world_size - 1] = values.numel()
        else:
            expected = torch.bincount(owner_rank(values.unique() if dedup else values, world_size),
                                      minlength=world_size)
            totals[0] += int(expected.sum())
            totals[1] += values.numel()
        assert ebc.id_counters.sent[name].tolist() == expected.tolist(), name
    return totals[0], totals[1]


def dedup_twins(rank: int, world_size: int, steps: int = 10) -> None:
    """Native TorchRec EBC vs dynamic EBC with row-wise id dedup (on and off),
    unweighted and weighted, SUM and MEAN (``dedup_twin`` for every variant)."""
    for weighted, tables, dedup in VARIANTS:
        dedup_twin(rank, world_size, weighted, tables, dedup, steps)


def _load_twin_rows(native, dynamic, tables: Dict) -> None:
    g = torch.Generator().manual_seed(5)
    for name, (rows, dim, _, _, _) in tables.items():
        weight = torch.rand(rows, dim, generator=g) - 0.5
        for shard in native.state_dict()[_key(name)].local_shards():
            r, c = shard.metadata.shard_offsets
            n, d = shard.metadata.shard_sizes
            shard.tensor.copy_(weight[r:r + n, c:c + d])
        import_dense_rows(dynamic, name, weight)


def dedup_twin(rank: int, world_size: int, weighted: bool, tables: Dict, dedup: bool, steps: int = 10) -> None:
    """One variant: outputs and losses at every step, rows after training, ids sent
    per destination; then batches in a training pipeline's order."""
    native = _build(world_size, weighted, tables, False)
    dynamic = _build(world_size, weighted, tables, True, dedup)
    assert "ebc.embedding_bags.d_rw1.weight" in dynamic.fused_optimizer.params
    assert {_key(n) for n in tables} <= set(dynamic.state_dict())
    _load_twin_rows(native, dynamic, tables)
    ids_sent = ids_given = 0
    for step in range(steps):
        features = _batch(step, rank, weighted, _features(tables))
        outs = []
        dynamic.module.ebc.id_counters.reset()
        for dmp in (native, dynamic):
            out = dmp(features)
            loss = _loss(out.values())
            loss.backward()
            dmp.fused_optimizer.step()
            outs.append((out, loss.detach()))
        (out_n, loss_n), (out_d, loss_d) = outs
        assert out_d.keys() == out_n.keys()
        torch.testing.assert_close(out_d.values(), out_n.values(),
                                   msg=lambda m: f"weighted={weighted} step {step}: {m}")
        torch.testing.assert_close(loss_d, loss_n)
        sent, given = _check_id_counters(dynamic, features, tables, world_size, dedup)
        ids_sent += sent
        ids_given += given
    for name, (rows, dim, _, _, _) in tables.items():
        dense = full_dense(native, _key(name), (rows, dim))
        keys, embs = all_rows(dynamic, name)
        assert sorted(keys.tolist()) == list(range(rows)), name
        torch.testing.assert_close(embs, dense[keys], msg=lambda m: f"{name} weighted={weighted}: {m}")
    assert (ids_sent < ids_given) == dedup, (ids_sent, ids_given)  # the batches do repeat ids
    _check_pipelined_batches(dynamic, rank, weighted, _features(tables))


def _check_pipelined_batches(dmp, rank: int, weighted: bool, features: List[str]) -> None:
    """A training pipeline's order (input dist of the next batch before the output
    dist of the current one) gives the outputs of one batch at a time."""
    ebc = dmp.module.ebc
    batches = [_batch(50 + i, rank, weighted, features) for i in range(3)]
    with torch.no_grad():
        one_at_a_time = [dmp(b).values() for b in batches]
        contexts = [ebc.create_context() for _ in batches]
        inputs = [ebc.input_dist(ctx, b) for ctx, b in zip(contexts, batches)]  # all three ahead
        for ctx, awaitable, expected in zip(contexts, inputs, one_at_a_time):
            out = ebc.compute_and_output_dist(ctx, awaitable.wait().wait()).wait()
            torch.testing.assert_close(out.values(), expected)
