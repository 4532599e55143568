"""What the sharded EmbeddingCollection and EmbeddingBagCollection share."""

from typing import Any, Dict, List, Mapping, Optional

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmEmbOptimType
from torch import nn
from torchrec.distributed.types import ParameterSharding
from torchrec.optim.fused import EmptyFusedOptimizer

from dynamicemb.checkpoint.tables import shard_kernels
from dynamicemb.embedding.module import BatchedDynamicEmbeddingTables
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb.planner.types import (CUSTOMIZED_KERNEL, DYNAMIC_SHARDING_TYPES,
                                      DynamicEmbParameterSharding,
                                      check_dynamic_sharding_type)


def check_dynamic_plan(params: Mapping[str, ParameterSharding]) -> None:
    """Refuses plans a dynamic table cannot run (before any sharding is built)."""
    for name, sharding in params.items():
        if sharding.compute_kernel != CUSTOMIZED_KERNEL:
            continue
        if not isinstance(sharding, DynamicEmbParameterSharding):
            raise ValueError(
                f"table {name!r} uses customized_kernel but its ParameterSharding is a "
                f"{type(sharding).__name__}; convert it with to_dynamic_sharding")
        check_dynamic_sharding_type(sharding.sharding_type, name)


def register_missing_placeholders(module: nn.Module, container: nn.ModuleDict) -> None:
    """Gives dynamic tables not stored on this rank (table-wise elsewhere) an empty
    ``weight``, as TorchRec's ``reset_parameters`` and state dicts expect one per table."""
    device = module._device if module._device is not None and module._device.type != "meta" else None
    for name, sharding in module.module_sharding_plan.items():
        if sharding.compute_kernel == CUSTOMIZED_KERNEL and not hasattr(container[name], "weight"):
            weight = nn.Parameter(torch.empty(0, device=device))
            weight._in_backward_optimizers = [EmptyFusedOptimizer()]
            container[name].register_parameter("weight", weight)


def get_dynamic_tables(module: nn.Module) -> Dict[str, BatchedDynamicEmbeddingTables]:
    """The ``BatchedDynamicEmbeddingTables`` holding each dynamic table stored on this
    rank (e.g. for ``export_keys_values``), by table name, anywhere in ``module``."""
    return {name: kernel.emb_module for name, kernel in shard_kernels(module)}


def import_dense_rows(module: nn.Module, table_name: str, weight: torch.Tensor) -> int:
    """Copies a dense (num_rows, dim) ``weight`` into a sharded dynamic table, key ``i`` = row
    ``i``; call it on every rank with the full table. Returns the rows this rank kept (owns)."""
    imported = 0
    for name, kernel in shard_kernels(module):
        if name != table_name:
            continue
        keys = torch.arange(weight.shape[0], dtype=torch.int64)
        mine = kernel.owns(table_name, keys)
        kernel.emb_module.import_keys_values(table_name, keys[mine], weight[mine].to(torch.float32))
        imported += int(mine.sum())
    return imported


def fbgemm_fused_params(params: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A sharder's fused params with this package's optimizer enum swapped for FBGEMM's
    member of that name (FBGEMM builds the static tables and knows only its own)."""
    if params is None or not isinstance(params.get("optimizer"), DynamicEmbOptimType):
        return params
    return {**params, "optimizer": FbgemmEmbOptimType[params["optimizer"].name]}


class DynamicKernelsMixin:
    """For a TorchRec sharder: offers ``customized_kernel`` for dynamic sharding types and
    gives static tables FBGEMM's ``EmbOptimType`` when ``fused_params`` name this package's."""

    @property
    def fused_params(self) -> Optional[Dict[str, Any]]:
        return fbgemm_fused_params(super().fused_params)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)
        if sharding_type in DYNAMIC_SHARDING_TYPES:
            kernels = kernels + [CUSTOMIZED_KERNEL]
        return kernels
