"""Rank bodies of the upstream-style flow test (spawned; importable, no pytest here).

Written as a user of NVIDIA's dynamicemb writes their example (an EmbeddingCollection
model, constraints with ``global_hbm_for_values`` and admission through a
``KVCounter``, ``DynamicEmbeddingShardingPlanner(eb_configs=...)`` with a
``DynamicEmbeddingEnumerator``, fused params with ``prefetch_pipeline``, DMP, caching,
dump, load, incremental dump), with upstream's names and arguments; the only edit is
the device (CPU, gloo) and synthetic data in place of MovieLens. The checks compare
against references: the same model without cache and without prefetch (identical
losses and rows), the admission rule over every id seen, the dumped model's outputs
after a load, and the rows a training interval touched.
"""

import os
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec import DataType
from torchrec.datasets.utils import Batch
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import (
    DynamicEmbDump,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbLoad,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
    get_sharded_table_capacity,
    get_table_value_bytes,
)
from dynamicemb.dump_load import find_sharded_modules, get_dynamic_emb_module
from dynamicemb.incremental_dump import get_score, incremental_dump
from dynamicemb.optimizer import EmbOptimType
from dynamicemb.planner import (
    DynamicEmbeddingEnumerator,
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterConstraints,
)
from dynamicemb.shard import DynamicEmbeddingCollectionSharder, get_dynamic_tables
from dynamicemb.shard.kernel import DynamicEmbEmbedding

DEVICE = torch.device("cpu")  # upstream: torch.device(f"cuda:{local_rank}")
FEATURES = {"user_id": 1000, "movie_id": 1000, "gender": 2, "age": 100, "occupation": 50,
            "year": 2050}
DIM, BATCH, STEPS, INC_STEPS = 8, 16, 6, 3
ADMISSION_THRESHOLD = 2
cache_ratio = 0.02  # upstream's example uses 50% of the table's bytes; small, to evict here


class MovieLensModel(nn.Module):
    def __init__(self, embedding_module: EmbeddingCollection, over_arch_layer_sizes: List[int]):
        super().__init__()
        self.embedding_module = embedding_module
        layers, width = [], DIM
        for size in over_arch_layer_sizes:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1))
        self.over_arch = nn.Sequential(*layers)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        embeddings = self.embedding_module(kjt)
        sparse = torch.cat([embeddings[k].values() for k in embeddings.keys()], dim=0)
        prediction = self.over_arch(sparse)
        num_features = len(kjt.keys())
        return prediction.view(num_features, -1).t().sum(-1)


def get_sharder(lr: float) -> DynamicEmbeddingCollectionSharder:
    fused_params = {"output_dtype": SparseType.FP32, "optimizer": EmbOptimType.ADAM,
                    "learning_rate": lr, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0,
                    "eps": 0.001, "prefetch_pipeline": True}
    return DynamicEmbeddingCollectionSharder(qcomm_codecs_registry=None, fused_params=fused_params,
                                             use_index_dedup=True)


def get_planner(eb_configs, caching: bool, batch_size: int) -> DynamicEmbeddingShardingPlanner:
    world_size, bucket_capacity = dist.get_world_size(), 128
    dict_const = {}
    for eb_config in eb_configs:
        value_bytes = get_table_value_bytes(eb_config, EmbOptimType.ADAM, world_size, bucket_capacity)
        global_hbm_for_values = int(value_bytes * cache_ratio) if caching else int(value_bytes)
        admission_counter = KVCounter(
            capacity=get_sharded_table_capacity(eb_config, world_size, bucket_capacity),
            bucket_capacity=1024, key_type=torch.int64)
        admit_strategy = FrequencyAdmissionStrategy(
            threshold=ADMISSION_THRESHOLD,
            initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT,
                                                       value=0.0))
        dict_const[eb_config.name] = DynamicEmbParameterConstraints(
            sharding_types=[ShardingType.ROW_WISE.value],
            use_dynamicemb=True,
            dynamicemb_options=DynamicEmbTableOptions(
                global_hbm_for_values=global_hbm_for_values,
                initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL),
                dist_type="roundrobin",
                score_strategy=DynamicEmbScoreStrategy.STEP,
                caching=caching,
                training=True,
                bucket_capacity=bucket_capacity,
                admit_strategy=admit_strategy,
                admission_counter=admission_counter,
            ),
        )
    topology = Topology(local_world_size=get_local_size(), world_size=world_size,
                        compute_device=DEVICE.type, hbm_cap=80 * 1024**3, ddr_cap=512 * 1024**3,
                        intra_host_bw=450e9, inter_host_bw=25e9)
    enumerator = DynamicEmbeddingEnumerator(topology=topology, constraints=dict_const)
    return DynamicEmbeddingShardingPlanner(
        eb_configs=eb_configs, topology=topology, constraints=dict_const, batch_size=batch_size,
        enumerator=enumerator, storage_reservation=HeuristicalStorageReservation(percentage=0.05),
        debug=True)


def create_model(caching: bool, lr: float = 0.05) -> DistributedModelParallel:
    torch.manual_seed(0)  # the dense layers: equal on every rank and in every model
    eb_configs = [EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=rows,
                                  feature_names=[name], data_type=DataType.FP32)
                  for name, rows in FEATURES.items()]
    ec = EmbeddingCollection(tables=eb_configs, device=torch.device("meta"))
    model = MovieLensModel(ec, over_arch_layer_sizes=[16, 8])
    sharder = get_sharder(lr)
    planner = get_planner(model.embedding_module.embedding_configs(), caching, BATCH)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(module=model, device=DEVICE, sharders=[sharder], plan=plan)


# --------------------------------------------------------------------------- data
def make_batch(step: int, rank: int) -> Batch:
    """A synthetic MovieLens batch of one rank: one id per feature per sample, drawn
    from a small pool so that ids repeat (admission needs two sightings)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    values = []
    for name, rows in FEATURES.items():
        pool = min(rows, 300 if rows >= 1000 else 40)
        values.append(torch.randint(0, pool, (BATCH,), generator=g) * max(1, rows // pool))
    kjt = KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values),
                            lengths=torch.ones(len(FEATURES) * BATCH, dtype=torch.int64))
    labels = torch.rand(BATCH, generator=g) * 5
    return Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=kjt, labels=labels)


def _global_ids(steps: range) -> Dict[str, Dict[int, int]]:
    """Per table, how often each id occurs in ``steps`` over every rank."""
    counts: Dict[str, Dict[int, int]] = {name: {} for name in FEATURES}
    for step in steps:
        for rank in range(dist.get_world_size()):
            kjt = make_batch(step, rank).sparse_features
            for name, ids in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
                for i in ids.tolist():
                    counts[name][i] = counts[name].get(i, 0) + 1
    return counts


def _all_rows(model) -> Dict[str, Dict[int, torch.Tensor]]:
    """Every stored row of every dynamic table, gathered from all ranks (read as
    upstream's embedding export reads them)."""
    local = {}
    for _, _, sharded in find_sharded_modules(model, ""):
        for module in get_dynamic_emb_module(sharded):
            for name in module.table_names:
                keys, embeddings = module.export_keys_values(name, device=torch.device("cpu"))
                local[name] = dict(zip(keys.tolist(), embeddings))
    parts: List = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: Dict[str, Dict[int, torch.Tensor]] = {}
    for part in parts:
        for name, rows in part.items():
            merged.setdefault(name, {}).update(rows)
    return merged


# -------------------------------------------------------------------------- train
def train_plain(model, steps: range, rank: int) -> List[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in steps:
        batch = make_batch(step, rank)
        loss = nn.functional.mse_loss(model(batch.sparse_features), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_prefetched(model, steps: range, rank: int) -> List[float]:
    """Training as TorchRec's ``PrefetchTrainPipelineSparseDist`` runs it on CUDA (on CPU
    it skips the prefetch): batch k+1's input dist and ``prefetch`` run between batch
    k's forward and its backward, and the sharded module's forward consumes them (the
    pipeline's ``PrefetchPipelinedForward``). Checked: every batch went through the
    dynamic kernel's prefetch."""
    sharded = model.module.embedding_module
    queue: List = []
    prefetched = []
    original = DynamicEmbEmbedding.prefetch

    def counting(self, features, forward_stream=None):
        prefetched.append(features.values().numel())
        return original(self, features, forward_stream)

    def start(step: int) -> Batch:
        batch = make_batch(step, rank)
        ctx = sharded.create_context()
        dist_input = sharded.input_dist(ctx, batch.sparse_features).wait().wait()
        sharded.prefetch(dist_input=dist_input, forward_stream=None, ctx=ctx)
        queue.append((ctx, dist_input))
        return batch

    def pipelined_forward(*args, **kwargs):
        ctx, dist_input = queue.pop(0)
        return sharded.compute_and_output_dist(ctx, dist_input)

    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    DynamicEmbEmbedding.prefetch = counting
    sharded.forward = pipelined_forward
    losses = []
    try:
        batch = start(steps[0])
        for i in range(len(steps)):
            loss = nn.functional.mse_loss(model(batch.sparse_features), batch.labels)
            if i + 1 < len(steps):
                batch = start(steps[i + 1])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        DynamicEmbEmbedding.prefetch = original
        del sharded.forward
    assert len(prefetched) == len(steps) and not queue, prefetched
    return losses


# -------------------------------------------------------------------------- checks
def _check_admission(rows: Dict[str, Dict[int, torch.Tensor]], steps: range) -> None:
    """A key is stored iff it was seen ADMISSION_THRESHOLD times (every rank's batches)."""
    for name, counts in _global_ids(steps).items():
        admitted = {k for k, c in counts.items() if c >= ADMISSION_THRESHOLD}
        assert set(rows[name]) == admitted, (name, len(rows[name]), len(admitted))
        assert admitted and (name != "user_id" or len(admitted) < len(counts)), name


def _check_rank_options(model) -> None:
    world = dist.get_world_size()
    lookups = {}
    for name, table in get_dynamic_tables(model).items():
        group, _ = table._location(name)
        config = EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=FEATURES[name],
                                 feature_names=[name])
        value_bytes = get_table_value_bytes(config, EmbOptimType.ADAM, world, 128)
        options = table.table_options[table.table_names.index(name)]
        assert options.local_hbm_for_values == -(-int(value_bytes * cache_ratio) // world), name
        assert group.admission is not None and group.admission.counter.lowest_first, name
        lookups[name] = table.cache_metrics()[name].lookups
        # dist_type="roundrobin", as upstream's example: key k lives on rank k % W
        keys = table.export_keys_values(name).keys
        assert bool((keys % world == dist.get_rank()).all()), (name, keys[keys % world != dist.get_rank()])
    # every table was looked up (roundrobin may give a rank none of a feature's ids:
    # the example's ages are all even)
    every = [None] * world
    dist.all_gather_object(every, lookups)
    assert all(sum(r.get(name, 0) for r in every) > 0 for name in FEATURES), every
    metrics = [m for t in get_dynamic_tables(model).values() for m in t.cache_metrics().values()]
    # a device cache over a host store: rows were found in the cache and read back
    # from the host
    assert sum(m.hits for m in metrics) > 0 and sum(m.host_reads for m in metrics) > 0, metrics


def upstream_flow(rank: int, world_size: int, save_dir: str) -> None:
    # train: cached and prefetched, against the uncached model without prefetch
    model = create_model(caching=True)
    reference = create_model(caching=False)
    losses = train_prefetched(model, range(STEPS), rank)
    want = train_plain(reference, range(STEPS), rank)
    assert losses == want, (losses, want)
    rows = _all_rows(model)
    want_rows = _all_rows(reference)
    assert rows.keys() == want_rows.keys()
    for name in rows:
        assert rows[name].keys() == want_rows[name].keys(), name
        for key, row in rows[name].items():
            assert torch.equal(row, want_rows[name][key]), (name, key)
    _check_admission(rows, range(STEPS))
    _check_rank_options(model)

    # dump, load into a fresh model: it predicts as the dumped one
    # the example's order: torch.save of the state dict every epoch, DynamicEmbDump
    # after the loop; its load reads the file with weights_only=True
    path = os.path.join(save_dir, "dynamicemb")
    torch.save({"model_state_dict": model.state_dict()},
               os.path.join(save_dir, f"model_rank{rank}.pt"))
    DynamicEmbDump(path, model, optim=True)
    dist.barrier()
    loaded = create_model(caching=True)
    checkpoint = torch.load(os.path.join(save_dir, f"model_rank{rank}.pt"), weights_only=True)
    loaded.load_state_dict(checkpoint["model_state_dict"], strict=False)
    DynamicEmbLoad(path, loaded, optim=True)
    model.eval()
    loaded.eval()
    with torch.inference_mode():
        for step in (0, STEPS + 5):  # seen ids, and mostly unseen ones
            kjt = make_batch(step, rank).sparse_features
            assert torch.equal(loaded(kjt), model(kjt)), step

    # incremental dump: exactly the rows the next steps touched, with their values
    loaded.train()
    undumped_score = get_score(loaded)
    steps = range(STEPS, STEPS + INC_STEPS)
    train_plain(loaded, steps, rank)
    ret_tensors, undumped_score = incremental_dump(loaded, undumped_score)
    after = _all_rows(loaded)
    touched = _global_ids(steps)
    dump_number = 0
    for module_path, named_tensors in ret_tensors.items():
        assert module_path == "model.embedding_module", module_path
        for table_name, tensors in named_tensors.items():
            dump_number += tensors[0].size(0)
            keys = tensors[0].tolist()
            assert set(keys) == set(after[table_name]) & set(touched[table_name]), table_name
            for key, row in zip(keys, tensors[1]):
                assert torch.equal(row, after[table_name][key]), (table_name, key)
    assert dump_number > 0
    again, _ = incremental_dump(loaded, undumped_score)
    assert sum(t[0].numel() for tables in again.values() for t in tables.values()) == 0
