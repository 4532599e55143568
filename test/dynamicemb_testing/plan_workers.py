"""Rank bodies of the plan-file DMP tests (spawned; importable, no pytest here)."""

from typing import Dict

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.plan import load_plan, to_sharding_plan
from dynamicemb.planner import DynamicEmbParameterConstraints, to_dynamic_sharding
from dynamicemb.shard import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
    get_dynamic_tables,
    import_dense_rows,
)

DIM = 4
# name -> (rows, features, placement, dynamic); placements: ("rw",), ("tw", rank), ("dp",)
EC_TABLES = {"ec_rw": (64, ["a", "b"], ("rw",), True), "ec_tw": (40, ["c"], ("tw", 1), True),
             "ec_static": (30, ["d"], ("tw", 0), False), "ec_dp": (20, ["e"], ("dp",), False)}
EBC_TABLES = {"ebc_rw": (64, ["f"], ("rw",), True), "ebc_tw": (40, ["g", "h"], ("tw", 0), True),
              "ebc_static": (30, ["i"], ("tw", 1), False), "ebc_dp": (20, ["j"], ("dp",), False)}
TABLES = {**EC_TABLES, **EBC_TABLES}

# The same placement as a HugeCTR plan file, in the older spelling. Lookups in
# module order: 0 a, 1 b (ec_rw), 2 c (ec_tw), 3 d, 4 e | 5 f (ebc_rw), 6 g, 7 h
# (ebc_tw), 8 i, 9 j.
PLAN_FILE = [
    [{"local_embedding_list": [3, 6, 7], "table_placement_strategy": "localized"},
     {"local_embedding_list": [4, 9], "table_placement_strategy": "dp"},
     {"local_embedding_list": [0, 1, 5], "table_placement_strategy": "mp",
      "sharding_id": 0, "num_sharding": 2}],
    [{"local_embedding_list": [2, 8], "table_placement_strategy": "localized"},
     {"local_embedding_list": [4, 9], "table_placement_strategy": "dp"},
     {"local_embedding_list": [0, 1, 5], "table_placement_strategy": "mp",
      "sharding_id": 1, "num_sharding": 2}],
]


class PlanModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=f)
            for n, (r, f, _, _) in EC_TABLES.items()], device=meta)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=f)
            for n, (r, f, _, _) in EBC_TABLES.items()], device=meta)

    def forward(self, ec_features: KeyedJaggedTensor, ebc_features: KeyedJaggedTensor):
        return self.ec(ec_features), self.ebc(ebc_features)


def constraints() -> Dict:
    return {name: DynamicEmbParameterConstraints(
        use_dynamicemb=True, sharding_types=["row_wise" if p[0] == "rw" else "table_wise"],
        dynamicemb_options=DynamicEmbTableOptions(dim=DIM, max_capacity=rows))
        for name, (rows, _, p, dynamic) in TABLES.items() if dynamic}


def sharders():
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    return [DynamicEmbeddingCollectionSharder(fused_params=fused),
            DynamicEmbeddingBagCollectionSharder(fused_params=fused)]


def hand_built_plan(model: PlanModel, world_size: int = 2) -> ShardingPlan:
    """The plan a user would write with TorchRec's helpers."""
    helpers = {"rw": lambda p: row_wise(compute_kernel="fused"),
               "tw": lambda p: table_wise(rank=p[1], compute_kernel="fused"),
               "dp": lambda p: data_parallel()}
    plans = {}
    for fqn, module, tables, sharder in (("ec", model.ec, EC_TABLES, sharders()[0]),
                                         ("ebc", model.ebc, EBC_TABLES, sharders()[1])):
        plan = construct_module_sharding_plan(
            module, {n: helpers[p[0]](p) for n, (_, _, p, _) in tables.items()}, sharder=sharder,
            local_size=get_local_size(world_size), world_size=world_size, device_type="cpu")
        for name, (rows, _, _, dynamic) in tables.items():
            if dynamic:
                plan[name] = to_dynamic_sharding(plan[name], DynamicEmbTableOptions(dim=DIM, max_capacity=rows))
        plans[fqn] = plan
    return ShardingPlan(plans)


def _weights():
    g = torch.Generator().manual_seed(3)
    return {n: torch.rand(r, DIM, generator=g) - 0.5 for n, (r, _, _, _) in TABLES.items()}


def _key(name: str) -> str:
    return f"{'ec.embeddings' if name in EC_TABLES else 'ebc.embedding_bags'}.{name}.weight"


def _load(dmp, weights) -> None:
    state = dmp.state_dict()
    for name, weight in weights.items():
        if TABLES[name][3]:
            import_dense_rows(dmp, name, weight)
            continue
        tensor = state[_key(name)]
        if isinstance(tensor, torch.Tensor) and not hasattr(tensor, "local_shards"):
            tensor.copy_(weight)  # data parallel: a replica on every rank
            continue
        for shard in tensor.local_shards():
            r, c = shard.metadata.shard_offsets
            rows, cols = shard.metadata.shard_sizes
            shard.tensor.copy_(weight[r:r + rows, c:c + cols])


def _kjt(features, generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 3, (len(features) * 4,), generator=generator)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor(keys=features, values=values, lengths=lengths)


def _rows(dmp, name: str):
    table = get_dynamic_tables(dmp).get(name)
    mine = table.export_keys_values(name) if table is not None else None
    local = (mine.keys, mine.embeddings) if mine is not None else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    keys = torch.cat([k for k, _ in filter(None, gathered)])
    rows = torch.cat([e for _, e in filter(None, gathered)])
    order = torch.argsort(keys)
    return keys[order], rows[order]


def translated_plan_trains_like_hand_built(rank: int, world_size: int, steps: int = 5) -> None:
    """The plan file's ShardingPlan equals the hand-built one, and DMP trains the same
    under both: outputs, losses and every row after ``steps`` steps."""
    model = PlanModel()
    translated = to_sharding_plan(load_plan(PLAN_FILE), model, constraints=constraints(),
                                  sharders=sharders())
    hand = hand_built_plan(model, world_size)
    assert translated == hand, f"{translated}\n!=\n{hand}"
    dmps = [DistributedModelParallel(PlanModel(), plan=p, sharders=sharders(),
                                     device=torch.device("cpu")) for p in (hand, translated)]
    weights = _weights()
    for dmp in dmps:
        _load(dmp, weights)
    ec_features = [f for _, f, _, _ in EC_TABLES.values() for f in f]
    ebc_features = [f for _, f, _, _ in EBC_TABLES.values() for f in f]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        ec, ebc = _kjt(ec_features, g), _kjt(ebc_features, g)
        results = []
        for dmp in dmps:
            ec_out, ebc_out = dmp(ec, ebc)
            loss = ((ebc_out.values() - 0.25) ** 2).sum() + sum(
                ((ec_out[n].values() - 0.25) ** 2).sum() for n in sorted(ec_out.keys()))
            loss.backward()
            dmp.fused_optimizer.step()
            results.append((ec_out, ebc_out, loss.detach()))
        (ec_a, ebc_a, loss_a), (ec_b, ebc_b, loss_b) = results
        for name in ec_a.keys():
            assert torch.equal(ec_a[name].values(), ec_b[name].values()), (step, name)
        assert torch.equal(ebc_a.values(), ebc_b.values()), step
        assert torch.equal(loss_a, loss_b), step
    for name, (_, _, _, dynamic) in TABLES.items():
        if dynamic:
            (ka, ra), (kb, rb) = _rows(dmps[0], name), _rows(dmps[1], name)
            assert torch.equal(ka, kb) and torch.equal(ra, rb), name
