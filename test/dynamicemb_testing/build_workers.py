"""Rank body of the repeated-build memory test (spawned; importable, no pytest here).

Upstream's ``test_twin_module`` pattern: a DMP model with a dynamic table and its
TorchRec twin are built, trained a few steps and dropped, again and again in one
process. Each build's memory must come back: after ``gc.collect()`` no dynamic
module and no large tensor is left, and the resident size after returning the
allocator's free pages (glibc ``malloc_trim``; freed memory it caches is not a
leak) stays within a bound far below one build's tables.
"""

import ctypes
import gc
import os
from typing import List

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, import_dense_rows

ROWS, DIM = 1 << 17, 128  # ids 0..ROWS-1, 64 MiB of them
# the dynamic table's capacity: twice its ids, as upstream's twin builder (a hash
# table filled to its last slot would evict)
SCALE = 2
FUSED = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.01, "eps": 1e-8}


def resident_mb() -> float:
    """This process's resident size in MiB after ``gc.collect()`` and, on glibc,
    ``malloc_trim(0)``."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model(world_size: int, dynamic: bool) -> DistributedModelParallel:
    rows = ROWS * SCALE if dynamic else ROWS
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="t", num_embeddings=rows, embedding_dim=DIM, feature_names=["f"])],
        device=torch.device("meta"))
    sharder = (DynamicEmbeddingBagCollectionSharder if dynamic else EmbeddingBagCollectionSharder)(
        fused_params=FUSED)
    plan = construct_module_sharding_plan(
        ebc, {"t": row_wise(compute_kernel="fused")}, sharder=sharder,
        local_size=get_local_size(world_size), world_size=world_size, device_type="cpu")
    if dynamic:
        plan["t"] = to_dynamic_sharding(plan["t"], DynamicEmbTableOptions(dim=DIM, max_capacity=rows))
    return DistributedModelParallel(ebc, plan=ShardingPlan({"": plan}), sharders=[sharder],
                                    device=torch.device("cpu"))


def _build_and_train(world_size: int, build: int) -> None:
    """One twin pair: the same rows in both, 3 training steps, equal outputs."""
    native, dynamic = _model(world_size, False), _model(world_size, True)
    weight = torch.rand(ROWS, DIM, generator=torch.Generator().manual_seed(build))
    for shard in native.state_dict()["embedding_bags.t.weight"].local_shards():
        r = shard.metadata.shard_offsets[0]
        shard.tensor.copy_(weight[r:r + shard.tensor.shape[0]])
    import_dense_rows(dynamic, "t", weight)
    g = torch.Generator().manual_seed(1000 + build)
    for step in range(3):
        lengths = torch.randint(0, 4, (64,), generator=g)
        kjt = KeyedJaggedTensor(keys=["f"], lengths=lengths,
                                values=torch.randint(0, ROWS, (int(lengths.sum()),), generator=g))
        outs = [m(kjt).values() for m in (native, dynamic)]
        for out in outs:
            out.sum().backward()
        torch.testing.assert_close(outs[1], outs[0], msg=lambda m: f"build {build} step {step}: {m}")


def repeated_twin_builds(rank: int, world_size: int, builds: int, bound_mb: float) -> None:
    """``builds`` twin pairs; after the first, the trimmed resident size grows by less
    than ``bound_mb`` and nothing of a dropped build stays alive."""
    sizes: List[float] = []
    for build in range(builds):
        _build_and_train(world_size, build)
        sizes.append(resident_mb())
        live = [o for o in gc.get_objects() if isinstance(o, BatchedDynamicEmbeddingTables)]
        big = [o for o in gc.get_objects()
               if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() >= 1 << 20]
        assert not live and not big, (
            f"build {build}: {len(live)} dynamic modules and {len(big)} tensors of >= 1 MiB "
            f"outlive their model")
    growth = max(sizes[1:]) - sizes[0]
    print(f"rank {rank}: resident MiB after each build {[round(s) for s in sizes]}", flush=True)
    assert growth < bound_mb, f"resident size grew {growth:.0f} MiB over {builds} builds: {sizes}"
    dist.barrier()
