"""Rank bodies of the sharded-Adam and sharded-fused-params tests (spawned;
importable, no pytest here).

TorchRec's CPU kernels have no Adam, so sharded dynamic tables trained with Adam are
checked against unsharded ``BatchedDynamicEmbeddingTables`` (one per collection, same
table names, options and feature_table_map, built with the same fused params as
keywords) that every rank feeds with the GLOBAL batch (all ranks' inputs, rebuilt
from the same seeds). The same harness checks that every fused param reaches the
sharded kernels (``sharded_vs_unsharded``). TorchRec divides gradients at
the kernel by the world size, so the reference loss is the sum of the ranks' losses
divided by the world size; both sides run one backward per step (Adam's global step
per table group is one per backward).
"""

from typing import Dict, List, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torch import nn
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from dynamicemb.embedding.fused_params import module_kwargs
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb_testing.shard_workers import TwinModel
from dynamicemb.shard import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
    get_dynamic_tables,
)
from dynamicemb_testing.placement_reference import owner

CPU = torch.device("cpu")
BATCH = 4
STEPS = 5
# name -> (num_embeddings, dim, features, sharding type); every table is dynamic
EC_TABLES = {"ec_rw": (64, 8, ["a", "b"], "row_wise"), "ec_tw": (40, 8, ["c"], "table_wise")}
EBC_TABLES = {"ebc_rw": (64, 8, ["e", "f"], "row_wise"), "ebc_tw": (40, 4, ["g"], "table_wise")}
# non-default betas and weight decay > 0, so hyper-parameters lost on the way would show
ADAM = {"learning_rate": 0.02, "eps": 1e-8, "beta1": 0.8, "beta2": 0.95, "weight_decay": 0.05}
FUSED = {"optimizer": EmbOptimType.ADAM, **ADAM}


def _options(name: str, dim: int, rows: int, dist_type: str = "hash",
             placement: Optional[str] = None) -> DynamicEmbTableOptions:
    # NORMAL rows are f(seed, table name, key, column): capacities do not matter
    init = DynamicEmbInitializerArgs(mode="normal", mean=0.0, std_dev=0.1, seed=11)
    return DynamicEmbTableOptions(dim=dim, max_capacity=rows, initializer_args=init,
                                  dist_type=dist_type, placement=placement)


def _id_pool(name: str) -> torch.Tensor:
    """The ids a table's features draw from: small, huge and negative int64."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    big = torch.randint(-(2**62), 2**62, (10,), generator=g) * 2 + 1
    return torch.cat([torch.arange(14), big, torch.tensor([2**63 - 1, -(2**63), -1])])


def _rank_batch(tables: Dict, step: int, rank: int) -> KeyedJaggedTensor:
    """The batch rank ``rank`` feeds at ``step`` (any rank can rebuild it)."""
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + len(tables))
    keys, lengths, values = [], [], []
    for name, (_, _, features, _) in tables.items():
        pool = _id_pool(name)
        for f in features:
            length = torch.randint(0, 5, (BATCH,), generator=g)
            keys.append(f)
            lengths.append(length)
            values.append(pool[torch.randint(0, pool.numel(), (int(length.sum()),), generator=g)])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _global_batch(batches: List[KeyedJaggedTensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All ranks' batches as one (batch = W * BATCH, rank-major samples) in TBE layout.

    Returns indices, offsets, and counts (F, W): ids of feature f on rank r.
    """
    world = len(batches)
    num_features = len(batches[0].keys())
    lengths = torch.stack([b.lengths().view(num_features, BATCH) for b in batches], 1)  # (F, W, B)
    per_rank = [b.values().split(b.length_per_key()) for b in batches]
    values = [per_rank[r][f] for f in range(num_features) for r in range(world)]
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.reshape(-1).cumsum(0)
    counts = torch.tensor([b.length_per_key() for b in batches]).T  # (F, W)
    return torch.cat(values), offsets, counts


def _plan(module: nn.Module, tables: Dict, sharder, world_size: int, dist_type: str,
          placement: Optional[str] = None):
    helpers = {name: (table_wise(rank=world_size - 1, compute_kernel="fused") if st == "table_wise"
                      else row_wise(compute_kernel="fused")) for name, (_, _, _, st) in tables.items()}
    plan = construct_module_sharding_plan(module, helpers, sharder=sharder, local_size=get_local_size(world_size),
                                          world_size=world_size, device_type="cpu")
    for name, (rows, dim, _, _) in tables.items():
        plan[name] = to_dynamic_sharding(plan[name], _options(name, dim, rows, dist_type, placement))
    return plan


def _sharded(world_size: int, fused: Dict, dedup: bool, dist_type: str = "hash",
             placement: Optional[str] = None) -> DistributedModelParallel:
    model = TwinModel(EC_TABLES, EBC_TABLES, {})
    ec_sharder = DynamicEmbeddingCollectionSharder(fused_params=fused, use_index_dedup=dedup)
    ebc_sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused, use_index_dedup=dedup)
    plan = ShardingPlan({"ec": _plan(model.ec, EC_TABLES, ec_sharder, world_size, dist_type, placement),
                         "ebc": _plan(model.ebc, EBC_TABLES, ebc_sharder, world_size, dist_type,
                                      placement)})
    return DistributedModelParallel(model, plan=plan, sharders=[ec_sharder, ebc_sharder], device=CPU)


def _reference(tables: Dict, pooling: DynamicEmbPoolingMode, fused: Dict) -> BatchedDynamicEmbeddingTables:
    names = list(tables)
    feature_table_map = [t for t, (_, _, features, _) in enumerate(tables.values()) for _ in features]
    return BatchedDynamicEmbeddingTables(
        [_options(n, d, r) for n, (r, d, _, _) in tables.items()], table_names=names,
        feature_table_map=feature_table_map, pooling_mode=pooling, **module_kwargs(fused))


def _features(tables: Dict) -> List[str]:
    return [f for _, _, features, _ in tables.values() for f in features]


def _feature_dims(tables: Dict) -> List[int]:
    return [d for _, d, features, _ in tables.values() for _ in features]


def _seq_loss(rows: torch.Tensor, feature: int) -> torch.Tensor:
    return ((rows - 0.25 * (feature + 1)) ** 2).sum()


def _pooled_loss(pooled: torch.Tensor) -> torch.Tensor:
    scale = torch.arange(1, pooled.shape[1] + 1, dtype=torch.float32) / pooled.shape[1]
    return ((pooled * scale - 0.1) ** 2).sum()


def sharded_adam_vs_unsharded(rank: int, world_size: int) -> None:
    """Adam (weight decay, non-default betas) on row-wise and table-wise dynamic tables
    of an EC and an EBC: outputs, losses, and finally every stored row and its Adam
    state against unsharded tables fed the global batch."""
    sharded_vs_unsharded(rank, world_size, FUSED, dedup=True)


def sharded_vs_unsharded(rank: int, world_size: int, fused: Dict, dedup: bool,
                         dist_type: str = "hash", placement: Optional[str] = None,
                         placed: Optional[Dict[str, Dict[int, int]]] = None) -> None:
    """Row-wise and table-wise dynamic tables of an EC and an EBC sharded with the
    sharders' ``fused`` params, against unsharded tables built with the same params as
    keywords and fed the global batch: outputs, losses, and finally every stored row
    and its optimizer state, each row on the rank ``dist_type`` names (computed by
    ``placement_reference``, not by the package), or, with a ``placement`` file, the
    rank ``placed[table][key]`` names for the keys it lists."""
    dmp = _sharded(world_size, fused, dedup, dist_type, placement)
    ref_ec = _reference(EC_TABLES, DynamicEmbPoolingMode.NONE, fused)
    ref_ebc = _reference(EBC_TABLES, DynamicEmbPoolingMode.SUM, fused)
    adam = DynamicEmbOptimType.of(fused["optimizer"]) == DynamicEmbOptimType.ADAM
    ec_features, ebc_features = _features(EC_TABLES), _features(EBC_TABLES)
    ebc_dims = _feature_dims(EBC_TABLES)
    for step in range(STEPS):
        ec_batches = [_rank_batch(EC_TABLES, step, r) for r in range(world_size)]
        ebc_batches = [_rank_batch(EBC_TABLES, step, r) for r in range(world_size)]

        # sharded: this rank's batch, one backward
        ec_out, ebc_out = dmp(ec_batches[rank], ebc_batches[rank])
        loss = sum(_seq_loss(ec_out[f].values(), i) for i, f in enumerate(ec_features))
        ebc_dict = ebc_out.to_dict()
        pooled = torch.cat([ebc_dict[f] for f in ebc_features], 1)
        loss = loss + _pooled_loss(pooled)
        loss.backward()
        dmp.fused_optimizer.step()

        # reference: the global batch, loss = sum of the ranks' losses / W, one backward
        indices, offsets, counts = _global_batch(ec_batches)
        ref_seq = ref_ec(indices, offsets)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.reshape(-1).cumsum(0)])
        ref_losses = [torch.zeros(()) for _ in range(world_size)]
        for i, f in enumerate(ec_features):
            for r in range(world_size):
                j = i * world_size + r
                rows = ref_seq[starts[j]:starts[j + 1]]
                ref_losses[r] = ref_losses[r] + _seq_loss(rows, i)
                if r == rank:
                    torch.testing.assert_close(ec_out[f].values(), rows.detach(),
                                               msg=lambda m: f"step {step} EC {f}: {m}")
                    assert torch.equal(ec_out[f].lengths(), ec_batches[rank][f].lengths())
        indices, offsets, _ = _global_batch(ebc_batches)
        ref_pooled = ref_ebc(indices, offsets)
        assert ref_pooled.shape == (world_size * BATCH, sum(ebc_dims))
        for r in range(world_size):
            mine = ref_pooled[r * BATCH:(r + 1) * BATCH]
            ref_losses[r] = ref_losses[r] + _pooled_loss(mine)
            if r == rank:
                torch.testing.assert_close(pooled, mine.detach(), msg=lambda m: f"step {step} EBC: {m}")
        torch.testing.assert_close(loss.detach(), ref_losses[rank].detach())
        (sum(ref_losses) / world_size).backward()

    # every stored row and Adam state: this rank's tables vs the reference's rows it owns
    tables = get_dynamic_tables(dmp)
    for ref, specs in ((ref_ec, EC_TABLES), (ref_ebc, EBC_TABLES)):
        for name, (_, dim, _, st) in specs.items():
            expected = ref.export_keys_values(name)
            if st == "row_wise":
                listed = (placed or {}).get(name, {})
                owned = torch.tensor([listed.get(k, owner(k, world_size, dist_type)) == rank
                                      for k in expected.keys.tolist()], dtype=torch.bool)
            else:
                owned = torch.full_like(expected.keys, rank == world_size - 1, dtype=torch.bool)
            if not bool(owned.any()):
                assert name not in tables or tables[name].table_size(name) == 0, name
                continue
            got = tables[name].export_keys_values(name)
            order_got, order_exp = got.keys.argsort(), expected.keys[owned].argsort()
            assert torch.equal(got.keys[order_got], expected.keys[owned][order_exp]), name
            assert tables[name].optimizer_args(name) == ref.optimizer_args(name), name
            for field in ("embeddings", "optimizer_states"):
                torch.testing.assert_close(getattr(got, field)[order_got],
                                           getattr(expected, field)[owned][order_exp],
                                           msg=lambda m: f"{name} {field}: {m}")
            if adam:  # the rows did move (Adam touched every stored row)
                assert got.optimizer_states.shape[1] == 2 * dim, name  # m and v
                assert bool((got.optimizer_states[:, dim:] > 0).all()), name
    if adam:  # both sides counted one Adam step per group per backward
        for module in [*tables.values(), ref_ec, ref_ebc]:
            assert all(g.update_count == STEPS for g in module._groups)


# Fused params beyond Adam's defaults, as TorchRec passes them to the sharded kernels.
# Gradient clipping needs dedup off: with it the kernel clamps each id's gradient
# summed over a rank's duplicates (as TorchRec's own dedup does), the reference each.
FUSED_CONFIGS = [
    ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-6,
      "initial_accumulator_value": 0.1, "weight_decay": 0.02,
      "weight_decay_mode": WeightDecayMode.DECOUPLE, "gradient_clipping": True,
      "max_gradient": 0.05, "stochastic_rounding": True, "prefetch_pipeline": True}, False),
    ({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.02, "betas": (0.8, 0.95), "eps": 1e-7,
      "weight_decay": 0.05, "weight_decay_mode": WeightDecayMode.L2,
      "output_dtype": SparseType.FP32}, True),
]


def sharded_fused_params(rank: int, world_size: int) -> None:
    """Each config of ``FUSED_CONFIGS`` reaches the sharded kernels (their optimizer
    settings equal the reference's, and so do outputs and rows); a fused param dynamic
    tables cannot honour stops DMP with its name."""
    for fused, dedup in FUSED_CONFIGS:
        sharded_vs_unsharded(rank, world_size, fused, dedup)
    try:
        _sharded(world_size, {"optimizer": EmbOptimType.EXACT_SGD, "max_norm": 1.0}, True)
    except ValueError as err:
        assert "max_norm" in str(err), err
    else:
        raise AssertionError("max_norm was accepted by the sharded kernel")
