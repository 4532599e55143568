"""Rank bodies of the hot-row replica tests (spawned; importable, no pytest here).

Two sharded models are built from the same EmbeddingCollection, options and
initializer (rows are f(seed, table, key)): one without replicas, one with. Both
train on the same per-rank batches of power-law ids (hot ids on every rank); their
outputs and trained rows are compared at every step and at the end.
"""

from typing import Dict, Optional, Union

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
from torchrec.distributed.comm import get_local_size
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
    owner_rank,
    refresh_replicas,
)
from dynamicemb.shard.replicas import replica_sets
from dynamicemb_testing.shard_workers import EcModel

CPU = torch.device("cpu")
BATCH = 16
# name -> (rows, features, sharding, replicas); "t_static" is TorchRec's own row-wise table
TABLES = {"t_hot": (4096, ["a", "b"], "row_wise", 8), "t_frac": (4096, ["c"], "row_wise", 0.05),
          "t_plain": (4096, ["d"], "row_wise", 0), "t_tw": (512, ["e"], "table_wise", 0),
          "t_static": (64, ["f"], None, 0)}
DIM = 8
OPTIMIZERS = {
    "sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05},
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05,
                        "eps": 1e-8},
    "adam": {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.02, "eps": 1e-8, "beta1": 0.8,
             "beta2": 0.95, "weight_decay": 0.01},
}
# With dedup each rank sends a hot id's gradient once and the owner sums them in rank
# order, as its kernel sums the rows the all-to-all brings: bit for bit. Without dedup
# a rank first sums its own occurrences of the id (the replica's gradient), then the
# owner sums over ranks: float32 rounding of that reordered sum, carried through the
# optimizer (rows ~0.1-1).
EXACT = {"atol": 0.0, "rtol": 0.0}
ROUNDING = {"atol": 1e-6, "rtol": 1e-5}


def _options(name: str, rows: int, replicas, staleness: int = 0) -> DynamicEmbTableOptions:
    init = DynamicEmbInitializerArgs(mode="normal", mean=0.0, std_dev=0.1, seed=5)
    return DynamicEmbTableOptions(dim=DIM, max_capacity=rows, initializer_args=init,
                                  score_strategy=DynamicEmbScoreStrategy.LFU, replicas=replicas,
                                  replica_staleness=staleness if replicas else 0)


def tables_for(fused: Dict, collection: str = "ec") -> Dict:
    """The tables: TorchRec's CPU kernels have no Adam, so no static table with it;
    none in an EBC (its dedup path, which replicas need, takes dynamic tables only)."""
    static = fused["optimizer"] != EmbOptimType.ADAM and collection == "ec"
    return {n: spec for n, spec in TABLES.items() if static or spec[2] is not None}


class EbcModel(nn.Module):
    """A model holding one EmbeddingBagCollection ``ebc``."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


def build(world_size: int, fused: Dict, with_replicas: bool, dedup: bool = True,
          collection: str = "ec", staleness: Union[int, Dict[str, int]] = 0,
          tables: Optional[Dict] = None) -> DistributedModelParallel:
    """The model (an EC, or an EBC with one MEAN table) on ``world_size`` ranks, with
    the tables' replicas or none (the static table's TorchRec init drawn from one seed);
    ``staleness``: their ``replica_staleness`` (one, or per table name, default 0);
    ``tables``: other tables than
    ``tables_for``'s (same form as ``TABLES``)."""
    torch.manual_seed(0)
    tables = tables_for(fused, collection) if tables is None else tables
    meta = torch.device("meta")
    if collection == "ec":
        module = EmbeddingCollection(tables=[
            EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=f)
            for n, (r, f, _, _) in tables.items()], device=meta)
        model = EcModel(module)
        sharder = DynamicEmbeddingCollectionSharder(fused_params=fused, use_index_dedup=dedup)
    else:
        module = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=DIM, feature_names=f,
                               pooling=PoolingType.MEAN if n == "t_frac" else PoolingType.SUM)
            for n, (r, f, _, _) in tables.items()], device=meta)
        model = EbcModel(module)
        sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused, use_index_dedup=dedup)
    helpers = {n: table_wise(rank=world_size - 1, compute_kernel="fused") if st == "table_wise"
               else row_wise(compute_kernel="fused") for n, (_, _, st, _) in tables.items()}
    plan = construct_module_sharding_plan(module, helpers, sharder=sharder, local_size=get_local_size(world_size),
                                          world_size=world_size, device_type="cpu")
    for n, (rows, _, st, replicas) in tables.items():
        if st is not None:
            stale = staleness.get(n, 0) if isinstance(staleness, dict) else staleness
            plan[n] = to_dynamic_sharding(plan[n], _options(n, rows, replicas if with_replicas else 0,
                                                            stale))
    return DistributedModelParallel(model, plan=ShardingPlan({collection: plan}), sharders=[sharder],
                                    device=CPU)


def _collection(dmp):
    """The sharded collection of a ``build`` model."""
    return dmp.module.ec if hasattr(dmp.module, "ec") else dmp.module.ebc


def power_law_batch(step: int, rank: int, tables: Dict = TABLES) -> KeyedJaggedTensor:
    """Rank ``rank``'s batch at ``step``: 0-3 ids per sample and feature, Zipf-like
    (id ``i`` drawn with weight 1 / (i + 1)), some negative, so a few ids are hot on
    every rank. Static table ids stay below its 64 rows."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    weights = 1.0 / torch.arange(1, 2001, dtype=torch.float64)
    keys, lengths, values = [], [], []
    for name, (rows, features, st, _) in tables.items():
        for f in features:
            length = torch.randint(0, 4, (BATCH,), generator=g)
            ids = torch.multinomial(weights, int(length.sum()), replacement=True, generator=g)
            if st is None:
                ids = ids % rows
            elif f in ("b", "c"):
                ids = torch.where(ids % 3 == 0, -ids - 7, ids)
            keys.append(f)
            lengths.append(length)
            values.append(ids)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _step(dmp, step: int, rank: int, tables: Dict = TABLES) -> Dict[str, torch.Tensor]:
    out = dmp(power_law_batch(step, rank, tables))
    if hasattr(dmp.module, "ebc"):  # a KeyedTensor
        out = out.to_dict()
        loss = sum(((out[f] - 0.1 * (i + 1)) ** 2).sum() for i, f in enumerate(out))
        loss.backward()
        return {f: v.detach() for f, v in out.items()}
    loss = sum(((out[f].values() - 0.1 * (i + 1)) ** 2).sum() for i, f in enumerate(out.keys()))
    loss.backward()
    return {f: out[f].values().detach() for f in out.keys()}


def all_rows(dmp, world_size: int) -> Dict[str, Dict[int, torch.Tensor]]:
    """Every rank's rows (embedding | optimizer state) of the dynamic tables, after
    checking that each rank holds only rows it owns (owner rows only)."""
    rank = dist.get_rank()
    mine = {}
    for name, module in get_dynamic_tables(dmp).items():
        rows = module.export_keys_values(name)
        if TABLES[name][2] == "row_wise":
            owners = owner_rank(rows.keys, world_size)
            assert bool((owners == rank).all()), f"{name}: rank {rank} holds rows it does not own"
        mine[name] = dict(zip(rows.keys.tolist(), torch.cat([rows.embeddings, rows.optimizer_states], 1)))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {n: {k: v for part in gathered for k, v in part.get(n, {}).items()}
            for n in mine}


def _sent_off_rank(dmp, rank: int) -> int:
    counters = _collection(dmp).id_counters
    return sum(int(s.sum()) - int(s[rank]) for s in counters.sent.values())


def replicas_train_like_no_replicas(rank: int, world_size: int, optimizer: str, dedup: bool = True,
                                    steps: int = 6, collection: str = "ec") -> None:
    """Outputs at every step and trained rows (embeddings and optimizer states) of
    the model with replicas equal those without (bit for bit with dedup); fewer ids
    cross the all-to-all; replicated ids are the same on every rank."""
    fused = OPTIMIZERS[optimizer]
    tolerance = EXACT if dedup else ROUNDING
    plain = build(world_size, fused, False, dedup, collection)
    replicated = build(world_size, fused, True, dedup, collection)
    sent = {"plain": 0, "replicated": 0}
    served = 0
    for step in range(steps):
        if step == 1:  # from the owners' LFU scores
            chosen = refresh_replicas(replicated)
            assert chosen["t_hot"] == 8 and 0 < chosen["t_frac"] < 400, chosen
        if step == 3:  # given: hot ids, an id no one looks up, one never seen
            refresh_replicas(replicated, {"t_hot": torch.tensor([0, 1, 2, -10, 10**15])})
        for model in (plain, replicated):
            _collection(model).id_counters.reset()
        tables = tables_for(fused, collection)
        want, got = _step(plain, step, rank, tables), _step(replicated, step, rank, tables)
        for f in want:
            torch.testing.assert_close(got[f], want[f], **tolerance, msg=f"step {step} feature {f}")
        sent["plain"] += _sent_off_rank(plain, rank)
        sent["replicated"] += _sent_off_rank(replicated, rank)
        served += _collection(replicated).id_counters.replicated
    _check_same_everywhere(replicated)
    _check_pipelined_batches(plain, replicated, rank, tables, tolerance)
    want, got = all_rows(plain, world_size), all_rows(replicated, world_size)
    for name in want:
        assert got[name].keys() == want[name].keys(), (name, set(got[name]) ^ set(want[name]))
        for key, row in want[name].items():
            torch.testing.assert_close(got[name][key], row, **tolerance, msg=f"{name} key {key}")
    assert served > 0 and sent["replicated"] < sent["plain"], (served, sent)


def _values(out, pooled: bool) -> torch.Tensor:
    """An EC's (JaggedTensors by feature) or an EBC's (``pooled``, a KeyedTensor)
    output as one tensor."""
    if pooled:
        return out.values()
    return torch.cat([out[f].values() for f in sorted(out.keys())])


def _check_pipelined_batches(plain, replicated, rank: int, tables: Dict, tolerance: Dict) -> None:
    """A training pipeline's order (the input dists of the next batches before the
    current one's lookup) gives, with replicas, the outputs of one batch at a time
    without them (rows trained to ``tolerance``): each batch's replica bookkeeping
    travels in its own context."""
    batches = [power_law_batch(60 + i, rank, tables) for i in range(3)]
    sharded = _collection(replicated)
    pooled = hasattr(replicated.module, "ebc")
    with torch.no_grad():
        want = [_values(plain(b), pooled) for b in batches]
        contexts = [sharded.create_context() for _ in batches]
        inputs = [sharded.input_dist(ctx, b) for ctx, b in zip(contexts, batches)]  # all ahead
        for ctx, awaitable, expected in zip(contexts, inputs, want):
            got = _values(sharded.compute_and_output_dist(ctx, awaitable.wait().wait()).wait(), pooled)
            torch.testing.assert_close(got, expected, **tolerance)


def _check_same_everywhere(dmp) -> None:
    ids = torch.cat([s.ids for s in replica_sets(dmp)])
    gathered = [torch.zeros_like(ids) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, ids)
    assert all(torch.equal(g, ids) for g in gathered), "replicated ids differ between ranks"


def eval_and_refusals(rank: int, world_size: int) -> None:
    """Eval (no grad) with replicas gives the outputs of no replicas; bad refreshes
    are refused and change nothing; an EBC without dedup refuses replicas."""
    try:
        build(world_size, OPTIMIZERS["rowwise_adagrad"], True, dedup=False, collection="ebc")
    except NotImplementedError as err:
        assert "need the dedup path" in str(err), str(err)
    else:
        raise AssertionError("an EBC without dedup took replicas")
    fused = OPTIMIZERS["rowwise_adagrad"]
    plain, replicated = build(world_size, fused, False), build(world_size, fused, True)
    for step in range(2):
        _step(plain, step, rank)
        _step(replicated, step, rank)
    refresh_replicas(replicated)
    before = torch.cat([s.ids for s in replica_sets(replicated)])
    for bad, says in (({"t_plain": torch.tensor([1])}, "have no replicas"),
                      ({"nope": torch.tensor([1])}, "have no replicas"),
                      ({"t_hot": torch.tensor([1.5])}, "1-D integer tensor"),
                      ({"t_hot": [1, 2]}, "1-D integer tensor")):
        try:
            refresh_replicas(replicated, bad)
        except ValueError as err:
            assert says in str(err), str(err)
        else:
            raise AssertionError(f"refresh_replicas accepted {bad}")
    assert torch.equal(torch.cat([s.ids for s in replica_sets(replicated)]), before)
    for model in (plain, replicated):
        model.eval()
    with torch.no_grad():
        batch = power_law_batch(50, rank)
        want, got = plain(batch), replicated(batch)
        for f in want.keys():
            torch.testing.assert_close(got[f].values(), want[f].values(), atol=0, rtol=0)


def checkpoints_hold_owner_rows(rank: int, world_size: int, directory: str) -> None:
    """A dump of a model with replicas loads into a model without (and back) with
    every row equal, nothing lost or doubled; the state dicts have the same keys."""
    from dynamicemb import DynamicEmbDump, DynamicEmbLoad  # noqa: PLC0415

    fused = OPTIMIZERS["rowwise_adagrad"]
    replicated = build(world_size, fused, True)
    for step in range(4):
        if step == 1:
            refresh_replicas(replicated)
        _step(replicated, step, rank)
    want = all_rows(replicated, world_size)
    DynamicEmbDump(directory, replicated)
    plain = build(world_size, fused, False)
    assert plain.state_dict().keys() == replicated.state_dict().keys()
    DynamicEmbLoad(directory, plain)
    again = build(world_size, fused, True)
    DynamicEmbLoad(directory, again)
    for got in (all_rows(plain, world_size), all_rows(again, world_size)):
        for name in want:
            assert got[name].keys() == want[name].keys(), name
            assert all(torch.equal(got[name][k], v) for k, v in want[name].items()), name
