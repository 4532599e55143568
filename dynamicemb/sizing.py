"""Sizing helpers with upstream dynamicemb's names and arguments, computed for the
tables this package builds (float32 rows, power-of-two bucket counts)."""

from typing import Any

import torch

from dynamicemb.ops.interface import RowFormat, num_buckets_for, optimizer_state_dim
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb.types import MAX_BUCKET_CAPACITY, row_dtype_of_data_type

__all__ = [
    "BUCKET_ALIGNMENT",
    "DEFAULT_BUCKET_CAPACITY",
    "DEMB_TABLE_ALIGN_SIZE",
    "align_to_table_size",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
]

#: ``bucket_capacity`` must be a multiple of this.
BUCKET_ALIGNMENT = 16
#: Upstream's default alignment of ``align_to_table_size``.
DEMB_TABLE_ALIGN_SIZE = 16

#: ``DynamicEmbTableOptions.bucket_capacity``'s default (upstream's name).
DEFAULT_BUCKET_CAPACITY = 128


def align_to_table_size(n: int, alignment: int = DEMB_TABLE_ALIGN_SIZE) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (at least one ``alignment``)."""
    if alignment <= 0:
        raise ValueError(f"alignment must be positive, got {alignment}")
    n = int(n)
    return alignment if n <= 0 else -(-n // alignment) * alignment


def get_sharded_table_capacity(embedding_config: Any, world_size: int,
                               bucket_capacity: int = DEFAULT_BUCKET_CAPACITY) -> int:
    """Rows one rank can hold of a table sharded row-wise over ``world_size`` ranks: its share
    ``ceil(num_embeddings / world_size)`` rounded up to a power of two of buckets.

    Args:
        embedding_config: the table's TorchRec config (``num_embeddings`` is read).
        world_size: ranks sharing the table (1 for table-wise).
        bucket_capacity: the table's ``bucket_capacity`` (a multiple of 16), or upstream's
            ``MAX_BUCKET_CAPACITY``: the share rounded up to 16 slots, as upstream sizes it
            (for budgets only; a table here refuses that ``bucket_capacity``).

    Raises:
        ValueError: ``world_size`` < 1 or ``bucket_capacity`` neither a positive multiple of
            16 nor ``MAX_BUCKET_CAPACITY``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if bucket_capacity == MAX_BUCKET_CAPACITY:
        return align_to_table_size(-(-int(embedding_config.num_embeddings) // world_size),
                                   BUCKET_ALIGNMENT)
    if bucket_capacity <= 0 or bucket_capacity % BUCKET_ALIGNMENT:
        raise ValueError(f"bucket_capacity must be a positive multiple of {BUCKET_ALIGNMENT}, "
                         f"got {bucket_capacity}")
    share = -(-int(embedding_config.num_embeddings) // world_size)
    return num_buckets_for(share, bucket_capacity) * bucket_capacity


def get_table_value_bytes(embedding_config: Any, optimizer_type: Any, world_size: int,
                          bucket_capacity: int = DEFAULT_BUCKET_CAPACITY) -> int:
    """Bytes of the value rows (embedding and optimizer state) of a whole table over
    ``world_size`` ranks; ``global_hbm_for_values`` set to this keeps every row in device memory.

    Args:
        embedding_config: the table's TorchRec config (``num_embeddings``, ``embedding_dim``;
            ``data_type`` FP32, FP16 or BF16: the rows' dtype).
        optimizer_type: ``EmbOptimType`` (ours or FBGEMM's).
        world_size: ranks sharing the table.
        bucket_capacity: as in ``get_sharded_table_capacity``.

    Raises:
        ValueError: another ``data_type``, or an argument ``get_sharded_table_capacity``
            refuses.
    """
    data_type = getattr(embedding_config, "data_type", None)
    dtype = (torch.float32 if data_type is None
             else row_dtype_of_data_type(data_type, embedding_config.name))
    dim = int(embedding_config.embedding_dim)
    state = optimizer_state_dim(DynamicEmbOptimType.of(optimizer_type), dim)
    rows = get_sharded_table_capacity(embedding_config, world_size, bucket_capacity) * world_size
    return rows * RowFormat(dtype, dim, state).row_bytes
