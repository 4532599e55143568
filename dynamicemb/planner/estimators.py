"""Planner estimators for dynamic tables: their hash tables' device and host bytes,
and a bandwidth for ``customized_kernel`` so the perf model can rank them."""

import math
from typing import List, Optional, Tuple

import torch
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingStorageEstimator,
    _calculate_storage_specific_sizes,
)
from torchrec.distributed.planner.types import ShardingOption, Storage
from torchrec.distributed.types import compute_storage_usage

from dynamicemb.ops.interface import (RowFormat, metadata_bytes_per_slot, num_buckets_for,
                                      optimizer_state_dim)
from dynamicemb.options import DynamicEmbOptimType, DynamicEmbTableOptions
from dynamicemb.planner.types import CUSTOMIZED_KERNEL, DynamicEmbParameterConstraints, resolve_options

__all__ = ["DynamicEmbPerfConfig", "DynamicEmbStorageEstimator", "dynamic_table_bytes",
           "external_table_bytes"]

def dynamic_table_bytes(options: DynamicEmbTableOptions, rows: int,
                        optimizer: DynamicEmbOptimType = DynamicEmbOptimType.EXACT_SGD,
                        num_shards: int = 1) -> Tuple[int, int]:
    """(device bytes, host bytes) of one rank's share of a dynamic table.

    ``rows`` round up to whole power-of-two buckets; each slot is a value row of the
    options' ``embedding_dtype`` (embedding and float32 optimizer state) plus its metadata (``metadata_bytes_per_slot``, as
    ``ScoredHashTable.memory_bytes`` counts). Without ``local_hbm_for_values`` all is on the
    device. Otherwise the device holds that budget of rows (a cache when ``caching``) with their
    index, plus every row's index; the host holds the other value rows (every row when
    ``caching``). A budget holding every row without ``caching`` keeps all on the device. With
    an external store and ``local_host_for_values`` the host holds at most that budget of rows
    (and their index); the rest is ``external_table_bytes``.

    Args:
        rows: the rank's capacity in rows.
        optimizer: the module's optimizer, unless ``options.optimizer_args`` names one.
        num_shards: ranks holding the table (``global_hbm_for_values`` is split over them).
    """
    slots, row_bytes = _slots_and_row_bytes(options, rows, optimizer)
    slots -= _external_rows(options, slots, row_bytes)
    values = slots * row_bytes
    bucket = options.bucket_slots(rows)
    index = math.ceil(slots * metadata_bytes_per_slot(bucket))
    budget = options.device_budget(num_shards)
    if budget is None or (not options.caching and budget >= values):
        return values + index, 0
    device = min(budget, values)
    device_index = math.ceil(device // row_bytes * metadata_bytes_per_slot(bucket))
    host = values if options.caching else values - device
    return device + device_index + index, host


def external_table_bytes(options: DynamicEmbTableOptions, rows: int,
                         optimizer: DynamicEmbOptimType = DynamicEmbOptimType.EXACT_SGD) -> int:
    """Bytes of rows of one rank's share of a table that live in its external store
    (rows beyond ``local_host_for_values``; 0 without an external store or budget),
    value rows and scores as the store packs them (keys excluded)."""
    slots, row_bytes = _slots_and_row_bytes(options, rows, optimizer)
    return _external_rows(options, slots, row_bytes) * (row_bytes + 8)


def _slots_and_row_bytes(options: DynamicEmbTableOptions, rows: int,
                         optimizer: DynamicEmbOptimType) -> Tuple[int, int]:
    if options.optimizer_args is not None:
        optimizer = options.optimizer_args.optimizer
    state_dim = optimizer_state_dim(DynamicEmbOptimType.of(optimizer), options.dim) if options.training else 0
    bucket = options.bucket_slots(rows)
    slots = num_buckets_for(rows, bucket) * bucket
    return slots, RowFormat(options.row_dtype, options.dim, state_dim).row_bytes


def _external_rows(options: DynamicEmbTableOptions, slots: int, row_bytes: int) -> int:
    if options.external_storage is None or options.local_host_for_values is None:
        return 0
    return max(0, slots - options.local_host_for_values // row_bytes)


class DynamicEmbStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, charging dynamic tables ``dynamic_table_bytes`` instead of
    dense weights; on a CPU topology device bytes are DDR bytes, and external-store rows go to
    the shard's SSD tier (``external_table_bytes``)."""

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map) -> None:
        super().estimate(sharding_options, sharder_data_map)
        for option in sharding_options:
            constraint = (self._constraints or {}).get(option.name)
            if option.compute_kernel != CUSTOMIZED_KERNEL or not isinstance(
                    constraint, DynamicEmbParameterConstraints) or not constraint.use_dynamicemb:
                continue
            fused_params = sharder_data_map[option.module_type_key].fused_params or {}
            optimizer = fused_params.get("optimizer", DynamicEmbOptimType.EXACT_SGD)
            dense = self._dense_bytes(option, sharder_data_map)
            on_device = self._topology.compute_device in ("cuda", "mtia")
            rows, dim = option.tensor.shape
            options = resolve_options(constraint.dynamicemb_options, option.name, dim, rows)
            for shard, (dense_hbm, dense_ddr) in zip(option.shards, dense):
                device, host = dynamic_table_bytes(options, shard.size[0], optimizer,
                                                   num_shards=len(option.shards))
                hbm = shard.storage.hbm - dense_hbm + (device if on_device else 0)
                ddr = shard.storage.ddr - dense_ddr + host + (0 if on_device else device)
                ssd = shard.storage.ssd + external_table_bytes(options, shard.size[0], optimizer)
                shard.storage = Storage(hbm=max(hbm, 0), ddr=max(ddr, 0), ssd=ssd)

    def _dense_bytes(self, option: ShardingOption, sharder_data_map) -> List[Tuple[int, int]]:
        """What TorchRec charged per shard for the table as a dense weight (hbm, ddr)."""
        sharder_data = sharder_data_map[option.module_type_key]
        usage = compute_storage_usage(option.tensor, self._topology.compute_device, option.compute_kernel,
                                      sharder_data.storage_usage_type)
        optimizer_class = getattr(option.tensor, "_optimizer_classes", [None])[0]
        shard_sizes = [shard.size for shard in option.shards]
        per_tier = [
            _calculate_storage_specific_sizes(
                storage=usage.get(tier, 0), shape=option.tensor.shape, shard_sizes=shard_sizes,
                sharding_type=option.sharding_type, optimizer_class=optimizer_class,
                is_inference=self._is_inference)
            for tier in ("hbm", "ddr")
        ]
        return list(zip(*per_tier))


class DynamicEmbPerfConfig(EmbeddingPerfEstimatorConfig):
    """TorchRec's perf config plus a bandwidth for ``customized_kernel``: ``bandwidth_fraction``
    of HBM (CUDA) or DDR (CPU) bandwidth, as hash probes are less regular than dense reads."""

    def __init__(self, bandwidth_fraction: float = 0.5) -> None:
        super().__init__()
        if not 0 < bandwidth_fraction <= 1:
            raise ValueError(f"bandwidth_fraction must be in (0, 1], got {bandwidth_fraction}")
        self.bandwidth_fraction = bandwidth_fraction

    def get_device_bw(self, compute_device: str, compute_kernel: str, hbm_mem_bw: float, ddr_mem_bw: float,
                      ssd_mem_bw: float, hbm_to_ddr_mem_bw: float, caching_ratio: Optional[float] = None,
                      prefetch_pipeline: bool = False) -> Optional[float]:
        if compute_kernel == CUSTOMIZED_KERNEL:
            on_device = compute_device in ("cuda", "mtia")
            return self.bandwidth_fraction * (hbm_mem_bw if on_device else ddr_mem_bw)
        return super().get_device_bw(compute_device, compute_kernel, hbm_mem_bw, ddr_mem_bw, ssd_mem_bw,
                                     hbm_to_ddr_mem_bw, caching_ratio, prefetch_pipeline)
