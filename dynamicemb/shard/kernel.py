"""The ``customized_kernel`` TorchRec builds for dynamic tables: a TorchRec embedding
kernel (sequence or pooled) around ``BatchedDynamicEmbeddingTables``."""

import dataclasses
import math
import warnings
from collections import OrderedDict
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.distributed.utils import append_prefix
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.checkpoint.tables import ShardKernel
from dynamicemb.embedding.fused_params import module_kwargs
from dynamicemb.embedding.module import BatchedDynamicEmbeddingTables
from dynamicemb.options import (
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from dynamicemb.placement import TablePlacement, owner_rank, table_placement
from dynamicemb.planner.types import DYNAMICEMB_OPTIONS_KEY, resolve_options, table_options
from dynamicemb.types import DynamicEmbDistType

__all__ = ["DynamicEmbEmbedding", "DynamicEmbEmbeddingBag", "DynamicEmbKeyedOptimizer"]

_POOLING = {
    PoolingMode.SUM: DynamicEmbPoolingMode.SUM,
    PoolingMode.MEAN: DynamicEmbPoolingMode.MEAN,
    PoolingMode.NONE: DynamicEmbPoolingMode.NONE,
}


class DynamicEmbKeyedOptimizer(FusedOptimizer):
    """The kernel's optimizer as TorchRec sees it (``model.fused_optimizer``).

    It shares the module optimizer's ``param_groups``, so an ``lr`` set here takes effect in
    the next backward; ``step`` and ``zero_grad`` do nothing (updates run inside backward), and
    the optimizer state lives in the hash tables' rows, not in ``state``.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], param_groups: List[Dict[str, Any]]) -> None:
        super().__init__(params, {}, param_groups)

    def step(self, closure: Any = None) -> None:
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = False) -> None:
        return None


def _rank_options(options: DynamicEmbTableOptions, table: ShardedEmbeddingTable) -> DynamicEmbTableOptions:
    """A table's options on this rank: ``resolve_options``, ``max_capacity`` = its share of
    ``num_embeddings``, ``init_capacity`` (per rank) capped to it, this rank's share of
    ``global_hbm_for_values``, uniform bounds defaulting to TorchRec's."""
    options = resolve_options(options, table.name, table.embedding_dim, table.num_embeddings,
                              table.data_type)
    num_shards = len(table.global_metadata.shards_metadata) if table.global_metadata else 1
    capacity = max(table.local_rows, math.ceil(table.num_embeddings / num_shards))
    init_capacity = None
    if options.init_capacity is not None:
        if options.init_capacity > capacity:
            warnings.warn(f"table {table.name!r}: init_capacity {options.init_capacity} exceeds "
                          f"this rank's capacity {capacity}; capped to it", UserWarning)
        init_capacity = min(capacity, options.init_capacity)
    init = options.initializer_args
    if init.mode == DynamicEmbInitializerMode.UNIFORM:
        init = dataclasses.replace(
            init,
            lower=table.get_weight_init_min() if init.lower is None else init.lower,
            upper=table.get_weight_init_max() if init.upper is None else init.upper,
        )
    return dataclasses.replace(options, max_capacity=capacity, init_capacity=init_capacity,
                               initializer_args=init,
                               local_hbm_for_values=options.device_budget(num_shards),
                               global_hbm_for_values=None)


def _frequencies(features: KeyedJaggedTensor) -> Optional[torch.Tensor]:
    """The occurrence counts deduplicated ids carry as weights (sequence kernels)."""
    counts = features.weights_or_none()
    return None if counts is None else counts.round().to(torch.int64)


def _after_prefetch(forward_stream) -> None:
    """A prefetch ran on the current stream: the forward stream waits for it."""
    if forward_stream is not None:
        forward_stream.wait_stream(torch.cuda.current_stream(forward_stream.device))


class _DynamicEmbKernelMixin(ShardKernel):
    """Shared by the sequence and pooled kernels: module, placeholders, optimizer."""

    def _build(self, config: GroupedEmbeddingConfig, device: Optional[torch.device],
               pooling: DynamicEmbPoolingMode) -> None:
        tables = config.embedding_tables
        options = [_rank_options(table_options(table), table) for table in tables]
        if device is not None and device.type == "meta":
            device = None
        self._emb_module = BatchedDynamicEmbeddingTables(
            options,
            table_names=[t.name for t in tables],
            feature_table_map=self._feature_table_map,
            pooling_mode=pooling,
            device=device,
            **module_kwargs(config.fused_params, skip=(DYNAMICEMB_OPTIONS_KEY,)),
        )
        self._rank = dist.get_rank(self._pg) if self._pg is not None else 0
        self._num_shards = {
            t.name: len(t.global_metadata.shards_metadata) if t.global_metadata else 1 for t in tables}
        self._dist_types = {t.name: o.dist_type for t, o in zip(tables, options)}
        self._placements = {t.name: table_placement(o.placement, t.name, self._num_shards[t.name])
                            for t, o in zip(tables, options)}
        placeholders = dict(self._emb_module.named_parameters_by_table())
        for p in placeholders.values():
            # keeps dense optimizers (in_backward_optimizer_filter) away from them
            p._in_backward_optimizers = [EmptyFusedOptimizer()]
        self._placeholders: Dict[str, nn.Parameter] = placeholders
        self._optim = DynamicEmbKeyedOptimizer(
            {f"{name}.weight": p for name, p in placeholders.items()},
            self._emb_module.optimizer.param_groups,
        )

    @property
    def emb_module(self) -> BatchedDynamicEmbeddingTables:
        return self._emb_module

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def owns(self, table_name: str, keys: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of ``keys`` (n,) int64 this rank stores (``owner_rank`` for a row-wise
        table, all for a table-wise one)."""
        num_shards = self._num_shards[table_name]
        if num_shards == 1:
            return torch.ones(keys.shape, dtype=torch.bool)
        return owner_rank(keys, num_shards, self._dist_types[table_name],
                          self._placements[table_name]) == self._rank

    def num_shards(self, table_name: str) -> int:
        """Shards of the table: the world size for row-wise, 1 for table-wise."""
        return self._num_shards[table_name]

    def dist_type(self, table_name: str) -> DynamicEmbDistType:
        """The table's placement of keys among its shards (``dist_type``)."""
        return self._dist_types[table_name]

    def placement(self, table_name: str) -> Optional[TablePlacement]:
        """The table's placement file entry (None: every key on its ``dist_type`` owner)."""
        return self._placements[table_name]

    def split_embedding_weights(self) -> List[torch.Tensor]:
        return list(self._placeholders.values())

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        # Hash-table rows are not dense tensors; dump them with export_keys_values.
        return destination if destination is not None else OrderedDict()

    def named_parameters_by_table(self) -> Iterator[Tuple[str, nn.Parameter]]:
        yield from self._placeholders.items()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, p in self._placeholders.items():
            yield append_prefix(prefix, f"{name}.weight"), p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        yield from ()

    def flush(self) -> None:
        self._emb_module.flush()

    def purge(self) -> None:
        pass


class DynamicEmbEmbedding(_DynamicEmbKernelMixin, BaseBatchedEmbedding[torch.Tensor], FusedOptimizerModule):
    """Sequence (EmbeddingCollection) kernel of dynamic tables; ``features`` weights, when
    present, are the dedup occurrence counts (passed on as ``frequencies``).

    Shape:
        forward(features) -> (number of ids, dim).
    """

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__(config, pg, device)
        self._build(config, device, DynamicEmbPoolingMode.NONE)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self._emb_module(features.values(), features.offsets(),
                                frequencies=_frequencies(features))

    def prefetch(self, features: KeyedJaggedTensor, forward_stream=None) -> None:
        """Looks up ``features`` ahead of ``forward`` (which must get the same ones)."""
        self._emb_module.prefetch(features.values(), features.offsets(),
                                  frequencies=_frequencies(features))
        _after_prefetch(forward_stream)


class DynamicEmbEmbeddingBag(_DynamicEmbKernelMixin, BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule):
    """Pooled (EmbeddingBagCollection) kernel of dynamic tables. Row-wise MEAN pools
    SUM here; TorchRec divides after the reduce-scatter.

    Shape:
        forward(features) -> (batch, sum of local feature dims).
    """

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[str] = None) -> None:
        super().__init__(config, pg, device, sharding_type)
        self._build(config, device, _POOLING[self._pooling])

    def forward(self, features: KeyedJaggedTensor, vbe_output: Optional[torch.Tensor] = None,
                vbe_output_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if vbe_output is not None or features.variable_stride_per_key():
            raise NotImplementedError("dynamic tables do not support variable batch sizes (VBE)")
        return self._emb_module(features.values(), features.offsets(), features.weights_or_none())

    def prefetch(self, features: KeyedJaggedTensor, forward_stream=None) -> None:
        """Looks up ``features`` ahead of ``forward`` (which must get the same ones)."""
        self._emb_module.prefetch(features.values(), features.offsets(),
                                  features.weights_or_none())
        _after_prefetch(forward_stream)
