"""Upstream's test helper ``dynamicemb.construct_twin_module``."""

import copy
import gc
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torchrec
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torch import nn

from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.planner.types import to_dynamic_sharding
from dynamicemb.shard import (DynamicEmbeddingBagCollectionSharder,
                              DynamicEmbeddingCollectionSharder, import_dense_rows)

__all__ = ["ConstructTwinModule"]

#: Upstream's optimizer names of ``optimizer_kwargs["optimizer"]``.
OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "exact_sgd": EmbOptimType.EXACT_SGD,
    "adam": EmbOptimType.ADAM,
    "exact_adagrad": EmbOptimType.EXACT_ADAGRAD,
    "exact_row_wise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


def _uniform(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.uniform_(0, 1)


class ConstructTwinModule:
    """A DMP model of dynamic tables ``t_<i>`` (features ``f_<i>``) and its TorchRec twin
    with equal rows, both row-wise over the default process group (call it on every rank).

    Args:
        table_num: tables; ``dims``, ``num_embeddings``, ``multi_hot_sizes``: one per table.
        num_embeddings: each table's rows in the TorchRec twin (ids ``0..n-1``).
        pooling_mode: TorchRec's ``PoolingType`` of pooled tables.
        is_pooled: ``EmbeddingBagCollection`` (True) or ``EmbeddingCollection``.
        multi_hot_sizes, batch_size: upstream's planner hints (unused).
        output_dtype: the outputs' ``SparseType``.
        fwd_a2a_precision, bwd_a2a_precision: ``CommType.FP32`` only.
        optimizer_kwargs: fused params with ``"optimizer"`` one of ``OPTIMIZERS``.
        use_index_dedup: the ``EmbeddingCollection`` sharders' dedup (twin: CUDA only).
        init_fn: fills a ``(num_embeddings, dim)`` weight (default: uniform in [0, 1));
            rank 0's rows are broadcast.
        rank, world_size: must be the default group's.
        scale_factor: dynamic capacity over ``num_embeddings`` (>= 1; no eviction).

    Raises:
        ValueError: for any argument outside the values above.
    """

    def __init__(self, table_num: int, dims: List[int], num_embeddings: List[int],
                 pooling_mode: Any, is_pooled: bool, multi_hot_sizes: List[int],
                 batch_size: int = 65536, output_dtype: SparseType = SparseType.FP32,
                 fwd_a2a_precision: CommType = CommType.FP32,
                 bwd_a2a_precision: CommType = CommType.FP32,
                 optimizer_kwargs: Optional[Dict[str, Any]] = None, use_index_dedup: bool = False,
                 init_fn: Optional[Callable[[torch.Tensor], Any]] = _uniform,
                 rank: int = 0, world_size: int = 1, scale_factor: int = 2) -> None:
        for name, values in (("dims", dims), ("num_embeddings", num_embeddings),
                             ("multi_hot_sizes", multi_hot_sizes)):
            if len(values) != table_num:
                raise ValueError(f"{name} must hold table_num={table_num} values, got {len(values)}")
        optimizer = dict(optimizer_kwargs or {"optimizer": "sgd", "learning_rate": 0.01})
        name = optimizer.pop("optimizer", None)
        if name not in OPTIMIZERS:
            raise ValueError(f"optimizer_kwargs['optimizer'] must be one of {sorted(OPTIMIZERS)}, "
                             f"got {name!r}")
        if fwd_a2a_precision != CommType.FP32 or bwd_a2a_precision != CommType.FP32:
            raise ValueError("quantized all-to-alls are not supported: fwd_a2a_precision and "
                             "bwd_a2a_precision must be CommType.FP32")
        if scale_factor < 1:
            raise ValueError(f"scale_factor must be >= 1, got {scale_factor}")
        if dist.is_initialized() and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
            raise ValueError(f"rank={rank}, world_size={world_size} disagree with the default "
                             f"process group's {dist.get_rank()}, {dist.get_world_size()}")
        self._dims, self._num_embeddings = list(dims), list(num_embeddings)
        self._pooling_mode, self._is_pooled = pooling_mode, is_pooled
        self._fused = {"output_dtype": output_dtype, "optimizer": OPTIMIZERS[name], **optimizer}
        self._use_index_dedup, self._init_fn = use_index_dedup, init_fn or _uniform
        self._world_size, self._scale_factor = world_size, scale_factor
        self._table_names = [f"t_{t}" for t in range(table_num)]
        self._feature_names = [f"f_{t}" for t in range(table_num)]
        self._dynamicemb_model: Optional[DistributedModelParallel] = None
        self._torchrec_model: Optional[DistributedModelParallel] = None

    def _collection(self, scale: int) -> nn.Module:
        kind = torchrec.EmbeddingBagConfig if self._is_pooled else torchrec.EmbeddingConfig
        extra = {"pooling": self._pooling_mode} if self._is_pooled else {}
        configs = [kind(name=t, embedding_dim=d, num_embeddings=n * scale, feature_names=[f],
                        **extra)
                   for t, f, d, n in zip(self._table_names, self._feature_names, self._dims,
                                         self._num_embeddings)]
        collection = (torchrec.EmbeddingBagCollection if self._is_pooled
                      else torchrec.EmbeddingCollection)
        return collection(tables=configs, device=torch.device("meta"))

    def _model(self, device: torch.device, dynamic: bool) -> DistributedModelParallel:
        collection = self._collection(self._scale_factor if dynamic else 1)
        fused = copy.deepcopy(self._fused)
        if self._is_pooled:
            sharder = (DynamicEmbeddingBagCollectionSharder if dynamic
                       else EmbeddingBagCollectionSharder)(fused_params=fused)
        else:  # TorchRec's dedup is a CUDA operator: its twin dedups on CUDA only
            dedup = self._use_index_dedup and (dynamic or device.type == "cuda")
            sharder = (DynamicEmbeddingCollectionSharder if dynamic else EmbeddingCollectionSharder)(
                fused_params=fused, use_index_dedup=dedup)
        plan = construct_module_sharding_plan(
            collection, {t: row_wise(compute_kernel="fused") for t in self._table_names},
            sharder=sharder,
            local_size=get_local_size(self._world_size), world_size=self._world_size,
            device_type=device.type)
        if dynamic:
            for t, d, n in zip(self._table_names, self._dims, self._num_embeddings):
                plan[t] = to_dynamic_sharding(plan[t], DynamicEmbTableOptions(
                    dim=d, max_capacity=n * self._scale_factor))
        return DistributedModelParallel(collection, plan=ShardingPlan({"": plan}),
                                        sharders=[sharder], device=device)

    def init_twin_embedding_model(self) -> None:
        """Builds both models and gives them the same rows (``init_fn``'s on rank 0)."""
        gc.collect()  # frees earlier models: sharded collections are reference cycles
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        self._torchrec_model = self._model(device, dynamic=False)
        self._dynamicemb_model = self._model(device, dynamic=True)
        prefix = "embedding_bags" if self._is_pooled else "embeddings"
        state = self._torchrec_model.state_dict()
        for table, dim, rows in zip(self._table_names, self._dims, self._num_embeddings):
            weight = torch.empty(rows, dim, device=device)
            self._init_fn(weight)
            if dist.is_initialized() and self._world_size > 1:
                dist.broadcast(weight, src=0)
            for shard in state[f"{prefix}.{table}.weight"].local_shards():
                start = shard.metadata.shard_offsets[0]
                shard.tensor.copy_(weight[start:start + shard.tensor.shape[0]])
            import_dense_rows(self._dynamicemb_model, table, weight.cpu())

    @property
    def dynamicemb_model(self) -> Optional[DistributedModelParallel]:
        """The model of dynamic tables (None before ``init_twin_embedding_model``)."""
        return self._dynamicemb_model

    @property
    def torchrec_model(self) -> Optional[DistributedModelParallel]:
        """The TorchRec twin (None before ``init_twin_embedding_model``)."""
        return self._torchrec_model
