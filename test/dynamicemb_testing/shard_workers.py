"""Rank bodies of the distributed tests (spawned; importable, no pytest here)."""

from typing import Dict, List

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbScoreStrategy, DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
    get_dynamic_tables,
    import_dense_rows,
    owner_rank,
)

CPU = torch.device("cpu")
DIM = 8
# name -> (num_embeddings, dim, features, dynamic sharding or None for static row-wise)
EC_TABLES = {"ec_rw": (64, DIM, ["a", "b"], "row_wise"), "ec_tw": (40, DIM, ["c"], "table_wise"),
             "ec_static": (30, DIM, ["d"], None)}
EBC_TABLES = {"ebc_rw": (64, DIM, ["e", "f"], "row_wise"), "ebc_tw": (40, 4, ["g"], "table_wise"),
              "ebc_static": (30, DIM, ["h"], None)}
EBC_POOLING = {"ebc_rw": PoolingType.SUM, "ebc_tw": PoolingType.MEAN, "ebc_static": PoolingType.SUM}
OPTIMIZERS = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
              "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}


class TwinModel(nn.Module):
    """An EC and an EBC on meta, from {name: (rows, dim, features, sharding type)}
    tables (the same model is sharded with static and with dynamic tables)."""

    def __init__(self, ec_tables: Dict = EC_TABLES, ebc_tables: Dict = EBC_TABLES,
                 ebc_pooling: Dict = EBC_POOLING) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f)
            for n, (r, d, f, _) in ec_tables.items()], device=torch.device("meta"))
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f,
                               pooling=ebc_pooling.get(n, PoolingType.SUM))
            for n, (r, d, f, _) in ebc_tables.items()], device=torch.device("meta"))

    def forward(self, ec_features: KeyedJaggedTensor, ebc_features: KeyedJaggedTensor):
        return self.ec(ec_features), self.ebc(ebc_features)


class EcModel(nn.Module):
    """A model holding one EmbeddingCollection ``ec``."""

    def __init__(self, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ec = ec

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ec(kjt)


def _plan(module: nn.Module, tables: Dict, sharder, world_size: int, dynamic: bool):
    helpers = {name: (table_wise(rank=world_size - 1, compute_kernel="fused") if st == "table_wise"
                      else row_wise(compute_kernel="fused")) for name, (_, _, _, st) in tables.items()}
    plan = construct_module_sharding_plan(module, helpers, sharder=sharder, local_size=get_local_size(world_size),
                                          world_size=world_size, device_type="cpu")
    if dynamic:
        for name, (rows, dim, _, st) in tables.items():
            if st is not None:
                plan[name] = to_dynamic_sharding(plan[name], DynamicEmbTableOptions(dim=dim, max_capacity=rows))
    return plan


def _build(world_size: int, optimizer: str, dynamic: bool, dedup: bool = True):
    fused = {"optimizer": OPTIMIZERS[optimizer], "learning_rate": 0.1, "eps": 1e-8}
    model = TwinModel()
    if dynamic:
        ec_sharder = DynamicEmbeddingCollectionSharder(fused_params=fused, use_index_dedup=dedup)
        ebc_sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused, use_index_dedup=dedup)
    else:
        ec_sharder = EmbeddingCollectionSharder(fused_params=fused)
        ebc_sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    plan = ShardingPlan({
        "ec": _plan(model.ec, EC_TABLES, ec_sharder, world_size, dynamic),
        "ebc": _plan(model.ebc, EBC_TABLES, ebc_sharder, world_size, dynamic),
    })
    return DistributedModelParallel(model, plan=plan, sharders=[ec_sharder, ebc_sharder], device=CPU)


def _initial_weights() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tables = {**EC_TABLES, **EBC_TABLES}
    return {n: torch.rand(r, d, generator=g) - 0.5 for n, (r, d, _, _) in tables.items()}


def _sharded_key(name: str) -> str:
    return f"{'ec.embeddings' if name in EC_TABLES else 'ebc.embedding_bags'}.{name}.weight"


def _set_dense(dmp, name: str, weight: torch.Tensor) -> None:
    tensor = dmp.state_dict()[_sharded_key(name)]
    for shard in tensor.local_shards():
        r, c = shard.metadata.shard_offsets
        rows, cols = shard.metadata.shard_sizes
        shard.tensor.copy_(weight[r:r + rows, c:c + cols])


def full_dense(dmp, key: str, shape) -> torch.Tensor:
    """The whole sharded dense table under state-dict ``key``, on every rank."""
    out = torch.empty(shape) if dist.get_rank() == 0 else None
    dmp.state_dict()[key].gather(0, out)
    full = out if out is not None else torch.empty(shape)
    dist.broadcast(full, 0)
    return full


def _full_dense(dmp, name: str, shape) -> torch.Tensor:
    return full_dense(dmp, _sharded_key(name), shape)


def all_rows(dmp, name: str):
    """(keys, rows) of a dynamic table gathered from every rank."""
    tables = get_dynamic_tables(dmp)
    mine = tables[name].export_keys_values(name) if name in tables else None
    local = (mine.keys, mine.embeddings) if mine is not None else (torch.empty(0, dtype=torch.int64), None)
    gathered: List = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    keys = torch.cat([k for k, _ in gathered])
    rows = torch.cat([e for _, e in gathered if e is not None])
    return keys, rows


def _kjt(features: List[str], rows: int, generator: torch.Generator, batch: int = 4) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(features) * batch,), generator=generator)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor(keys=features, values=values, lengths=lengths)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    # ids of a KJT must fit every feature's table: draw below the smallest table
    ec = _kjt([f for _, _, fs, _ in EC_TABLES.values() for f in fs], 30, g)
    ebc = _kjt([f for _, _, fs, _ in EBC_TABLES.values() for f in fs], 30, g)
    return ec, ebc


def _loss(ec_out, ebc_out) -> torch.Tensor:
    loss = ((ebc_out.values() - 0.25) ** 2).sum()
    for name in sorted(ec_out.keys()):
        loss = loss + ((ec_out[name].values() - 0.25) ** 2).sum()
    return loss


def _load_twins(native, dynamic) -> None:
    """The same initial rows into the native twin and the dynamic model."""
    for name, weight in _initial_weights().items():
        _set_dense(native, name, weight)
        if (EC_TABLES.get(name) or EBC_TABLES[name])[3] is None:
            _set_dense(dynamic, name, weight)
        else:
            import_dense_rows(dynamic, name, weight)


def _train_twins(native, dynamic, rank: int, steps: int) -> None:
    """Trains both on the same batches: equal outputs and losses at every step, and
    equal rows at the end."""
    for step in range(steps):
        ec, ebc = _batch(step, rank)
        outs = []
        for dmp in (native, dynamic):
            ec_out, ebc_out = dmp(ec, ebc)
            loss = _loss(ec_out, ebc_out)
            loss.backward()
            dmp.fused_optimizer.step()
            outs.append((ec_out, ebc_out, loss.detach()))
        (ec_n, ebc_n, loss_n), (ec_d, ebc_d, loss_d) = outs
        for name in ec_n.keys():
            torch.testing.assert_close(ec_d[name].values(), ec_n[name].values())
            assert torch.equal(ec_d[name].lengths(), ec_n[name].lengths())
        torch.testing.assert_close(ebc_d.values(), ebc_n.values())
        torch.testing.assert_close(loss_d, loss_n)
        assert torch.isfinite(loss_d)
    for tables in (EC_TABLES, EBC_TABLES):
        for name, (rows, dim, _, st) in tables.items():
            dense = _full_dense(native, name, (rows, dim))
            if st is None:
                torch.testing.assert_close(_full_dense(dynamic, name, (rows, dim)), dense)
                continue
            keys, embs = all_rows(dynamic, name)
            assert sorted(keys.tolist()) == list(range(rows)), name
            torch.testing.assert_close(embs, dense[keys], msg=lambda m: f"{name}: {m}")


def twin_models(rank: int, world_size: int, optimizer: str, steps: int = 10, dedup: bool = True) -> None:
    """Native TorchRec tables vs the same tables dynamic: outputs, losses, rows."""
    native, dynamic = _build(world_size, optimizer, False), _build(world_size, optimizer, True, dedup)
    _load_twins(native, dynamic)
    assert "ec.embeddings.ec_rw.weight" in dynamic.fused_optimizer.params
    _train_twins(native, dynamic, rank, steps)
    _check_shared_learning_rate(dynamic, rank)


def _check_shared_learning_rate(dmp, rank: int) -> None:
    """lr set through model.fused_optimizer reaches the dynamic tables' backward."""
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = 0.0
    before = all_rows(dmp, "ec_rw")
    ec, ebc = _batch(99, rank)
    _loss(*dmp(ec, ebc)).backward()
    after = all_rows(dmp, "ec_rw")
    order_b, order_a = before[0].argsort(), after[0].argsort()
    torch.testing.assert_close(after[1][order_a], before[1][order_b])


def debug_init_and_dedup(rank: int, world_size: int) -> None:
    """DEBUG rows after the all-to-all; ids sent = unique ids per (table, destination);
    occurrence counts reach the owner (LFU scores)."""
    debug = DynamicEmbInitializerArgs(mode="debug")
    tables = {"dbg_rw": ["p", "q"], "dbg_tw": ["s"]}
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name=n, num_embeddings=1 << 12, embedding_dim=4, feature_names=f)
        for n, f in tables.items()], device=torch.device("meta"))
    sharder = DynamicEmbeddingCollectionSharder(fused_params={"learning_rate": 0.0})
    plan = construct_module_sharding_plan(
        ec, {"dbg_rw": row_wise(compute_kernel="fused"), "dbg_tw": table_wise(rank=0, compute_kernel="fused")},
        sharder=sharder, local_size=get_local_size(world_size), world_size=world_size, device_type="cpu")
    for name in tables:
        plan[name] = to_dynamic_sharding(plan[name], DynamicEmbTableOptions(
            dim=4, max_capacity=1 << 12, initializer_args=debug, score_strategy=DynamicEmbScoreStrategy.LFU))

    dmp = DistributedModelParallel(EcModel(ec), plan=ShardingPlan({"ec": plan}), sharders=[sharder], device=CPU)
    big = [2**63 - 1, 2**62 + 5, 10**15, 123456789]
    ids = {"p": [[5, 5, big[0]], [7], [5]], "q": [[big[1 + rank]], [], [5, 8]],
           "s": [[3, 3], [big[3], 4], [rank]]}
    keys = ["p", "q", "s"]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor([v for k in keys for b in ids[k] for v in b]),
                            lengths=torch.tensor([len(b) for k in keys for b in ids[k]]))
    out = dmp(kjt)
    for k in keys:
        expected = torch.tensor([float(v % 100000) for b in ids[k] for v in b]).view(-1, 1).expand(-1, 4)
        torch.testing.assert_close(out[k].values(), expected)
        assert out[k].lengths().tolist() == [len(b) for b in ids[k]]
    counters = dmp.module.ec.id_counters
    for name, features in tables.items():
        values = torch.tensor([v for f in features for b in ids[f] for v in b])
        unique = values.unique()
        dest = owner_rank(unique, world_size) if name == "dbg_rw" else torch.zeros_like(unique)
        assert counters.sent[name].tolist() == torch.bincount(dest, minlength=world_size).tolist(), name
        assert counters.before_dedup[name] == values.numel()
    # LFU scores on the owner count every occurrence on every rank (frequencies travel)
    all_ids: List = [None] * world_size
    dist.all_gather_object(all_ids, [v for f in tables["dbg_rw"] for b in ids[f] for v in b])
    expected_counts: Dict[int, int] = {}
    for part in all_ids:
        for v in part:
            expected_counts[v] = expected_counts.get(v, 0) + 1
    rows = get_dynamic_tables(dmp)["dbg_rw"].export_keys_values("dbg_rw")
    mine = {k: c for k, c in expected_counts.items()
            if int(owner_rank(torch.tensor([k]), world_size)) == rank}
    assert dict(zip(rows.keys.tolist(), rows.scores.tolist())) == mine


def planned_model(rank: int, world_size: int, steps: int = 4) -> None:
    """collective_plan with dynamic constraints, then DMP trains: dynamic and static
    tables side by side, the fused optimizer lists both, and outputs, losses and rows
    equal those of the native TorchRec twin (hand-built plan) fed the same batches."""
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from dynamicemb.planner import DynamicEmbeddingShardingPlanner, DynamicEmbParameterConstraints

    model = TwinModel()
    constraints = {}
    for tables in (EC_TABLES, EBC_TABLES):
        for name, (rows, dim, _, st) in tables.items():
            if st is None:
                constraints[name] = ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"])
            else:
                # the EBC's dynamic tables leave dim and max_capacity to the planner
                options = (DynamicEmbTableOptions(dim=dim, max_capacity=rows) if name in EC_TABLES
                           else DynamicEmbTableOptions())
                constraints[name] = DynamicEmbParameterConstraints(
                    use_dynamicemb=True, sharding_types=[st], dynamicemb_options=options)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1, "eps": 1e-8}  # as _build's
    sharders = [DynamicEmbeddingCollectionSharder(fused_params=fused),
                DynamicEmbeddingBagCollectionSharder(fused_params=fused)]
    topology = Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu")
    planner = DynamicEmbeddingShardingPlanner(topology, batch_size=4, constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders, device=CPU)
    params = set(dmp.fused_optimizer.params)
    assert {"ec.embeddings.ec_rw.weight", "ec.embeddings.ec_static.weight"} <= params
    native = _build(world_size, "sgd", False)
    _load_twins(native, dmp)
    _train_twins(native, dmp, rank, steps)
    tables = get_dynamic_tables(dmp)
    assert tables["ec_rw"].table_size("ec_rw") > 0


def debug_init_dedup_and_planner(rank: int, world_size: int) -> None:
    debug_init_and_dedup(rank, world_size)
    planned_model(rank, world_size)


def data_parallel_beside_dynamic(rank: int, world_size: int) -> None:
    """A static data-parallel EC table beside a dynamic one: sequence outputs (TorchRec's
    CPU kernel would pool them), and DDP's averaged gradient on the replica."""
    from torchrec.distributed.sharding_plan import data_parallel

    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="dp", num_embeddings=20, embedding_dim=4, feature_names=["x", "z"]),
        EmbeddingConfig(name="dyn", num_embeddings=64, embedding_dim=4, feature_names=["y"])],
        device=torch.device("meta"))
    sharder = DynamicEmbeddingCollectionSharder(fused_params={"learning_rate": 0.1})
    plan = construct_module_sharding_plan(
        ec, {"dp": data_parallel(), "dyn": row_wise(compute_kernel="fused")}, sharder=sharder,
        local_size=get_local_size(world_size), world_size=world_size, device_type="cpu")
    plan["dyn"] = to_dynamic_sharding(plan["dyn"], DynamicEmbTableOptions(dim=4, max_capacity=64))

    dmp = DistributedModelParallel(EcModel(ec), plan=ShardingPlan({"ec": plan}), sharders=[sharder], device=CPU)
    weight = torch.rand(20, 4, generator=torch.Generator().manual_seed(3))
    dmp.state_dict()["ec.embeddings.dp.weight"].copy_(weight)
    ids = {"x": [[1, 2, 2], [rank + 5]], "y": [[7], [8, 9]], "z": [[], [3, 1]]}
    keys = ["x", "y", "z"]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor([v for k in keys for b in ids[k] for v in b]),
                            lengths=torch.tensor([len(b) for k in keys for b in ids[k]]))
    out = dmp(kjt)
    scale = torch.arange(1.0, 5.0)
    loss = torch.zeros(())
    for k in ("x", "z"):
        flat = [v for b in ids[k] for v in b]
        torch.testing.assert_close(out[k].values(), weight[flat])
        assert out[k].lengths().tolist() == [len(b) for b in ids[k]]
        loss = loss + (out[k].values() * scale).sum()
    loss.backward()
    # DDP averages the replicas' gradients: d loss / d row = scale per occurrence
    all_ids: List = [None] * world_size
    dist.all_gather_object(all_ids, [v for k in ("x", "z") for b in ids[k] for v in b])
    expected = torch.zeros(20, 4)
    for part in all_ids:
        for v in part:
            expected[v] += scale / world_size
    [grad] = [p.grad for n, p in dmp.named_parameters() if n.endswith("embeddings.dp.weight")]
    torch.testing.assert_close(grad.view(20, 4), expected)
