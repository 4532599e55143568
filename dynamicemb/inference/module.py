"""``InferenceEmbeddingTables``: frozen dynamic tables behind the training module's call."""

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from dynamicemb.inference.frozen import FrozenGroup
from dynamicemb.inference.ops import POOLING_CODES, frozen_lookup
from dynamicemb.ops import resolve_device
from dynamicemb.options import DynamicEmbPoolingMode, DynamicEmbTableOptions
from dynamicemb.table.checks import check_batch_types
from dynamicemb.types import check_row_dtype

__all__ = ["InferenceEmbeddingTables"]

#: Rows: table name -> (keys (n,) int64, embeddings (n, dim)).
Rows = Mapping[str, Tuple[torch.Tensor, torch.Tensor]]


class InferenceEmbeddingTables(nn.Module):
    """Dynamic tables frozen for serving: lookup only, no optimizer state.

    Calls and outputs are ``BatchedDynamicEmbeddingTables``' in eval (bit for bit with
    rows of the tables' own dtype): unseen ids get the table's eval initializer row, as
    a stored row would hold it. Lookups run ``torch.ops.dynamicemb.frozen_lookup``, so
    ``torch.compile`` and ``torch.export`` trace the module.

    Args:
        table_options: one ``DynamicEmbTableOptions`` per table (``dim``,
            ``max_capacity`` and ``eval_initializer_args`` are read).
        table_names: the tables' names (their initializer streams; default ``t0, …``).
        feature_table_map: table of each feature (default: one feature per table).
        rows: table name -> (keys (n,) int64, embeddings (n, dim)) for every table.
        pooling_mode: SUM, MEAN or NONE (NONE: one dim for all tables).
        dtype: how rows are stored: float32, float16 or bfloat16 (rows of another
            dtype rounded to nearest once; lookups and pooling run in float32); None:
            the tables' ``row_dtype`` (``embedding_dtype``), one for all tables.
        output_dtype, device: the output's dtype; where rows live (default CPU).

    Example::

        twin = InferenceEmbeddingTables.from_module(trained, dtype=torch.float16)
        program = torch.export.export(twin, (indices, offsets))
    """

    def __init__(self, table_options: Sequence[DynamicEmbTableOptions],
                 table_names: Optional[Sequence[str]] = None,
                 feature_table_map: Optional[Sequence[int]] = None, *, rows: Rows,
                 pooling_mode: DynamicEmbPoolingMode = DynamicEmbPoolingMode.SUM,
                 dtype: Optional[torch.dtype] = None,
                 output_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        options = list(table_options)
        names = list(table_names) if table_names is not None else [
            f"t{i}" for i in range(len(options))]
        features = list(feature_table_map) if feature_table_map is not None else list(
            range(len(options)))
        _check_tables(options, names, features, rows)
        self.dtype = check_row_dtype(_tables_dtype(options, names) if dtype is None else dtype)
        self.output_dtype = check_row_dtype(output_dtype, "output_dtype")
        self.pooling_mode = DynamicEmbPoolingMode(pooling_mode)
        self.table_names = names
        self.feature_table_map = features
        self.feature_dims = [options[t].dim for t in features]
        if self.pooling_mode == DynamicEmbPoolingMode.NONE and len(set(self.feature_dims)) > 1:
            raise ValueError(f"pooling NONE needs one dim for all tables, got "
                             f"{sorted(set(self.feature_dims))}")
        device = resolve_device(device if device is not None else "cpu")
        self.num_features = len(features)
        self.out_cols = sum(self.feature_dims)
        self.groups = nn.ModuleList(self._groups(options, rows, device))

    def _groups(self, options, rows: Rows, device) -> List[FrozenGroup]:
        """One frozen group per dim."""
        starts = [0]
        for d in self.feature_dims[:-1]:
            starts.append(starts[-1] + d)
        feature_names = [self.table_names[t] for t in self.feature_table_map]
        groups = []
        for dim in dict.fromkeys(o.dim for o in options):
            mine = [t for t, o in enumerate(options) if o.dim == dim]
            cols = [s if options[t].dim == dim else -1
                    for s, t in zip(starts, self.feature_table_map)]
            groups.append(FrozenGroup([self.table_names[t] for t in mine],
                                      [options[t] for t in mine], rows, self.dtype,
                                      feature_names, cols, device))
        return groups

    @classmethod
    def from_module(cls, module: nn.Module, dtype: Optional[torch.dtype] = None,
                    device: Optional[torch.device] = None) -> "InferenceEmbeddingTables":
        """The inference twin of a ``BatchedDynamicEmbeddingTables`` (its current rows;
        rows of its tables' dtype and its device unless given)."""
        rows = {}
        for name in module.table_names:
            exported = module.export_keys_values(name)
            rows[name] = (exported.keys, exported.embeddings)
        return cls(module.table_options, module.table_names, module.feature_table_map,
                   rows=rows, pooling_mode=module.pooling_mode, dtype=dtype,
                   output_dtype=module.output_dtype,
                   device=device if device is not None else module.device)

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes held: ``index`` (hash metadata and slot -> row maps) and ``rows``."""
        total = {"index": 0, "rows": 0}
        for g in self.groups:
            for key, value in g.memory_bytes().items():
                total[key] += value
        return total

    def num_rows(self) -> int:
        """Rows stored over all tables."""
        return sum(int(g.rows.shape[0]) for g in self.groups)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Looks ids up and pools them per bag.

        Args:
            indices (Tensor): (N,) int32/int64 raw ids, feature-major.
            offsets (Tensor): (F * B + 1,) int32/int64, non-decreasing from 0 to N.
            per_sample_weights (Tensor, optional): (N,) float weights (SUM only).

        Returns:
            (B, sum of feature dims) for SUM/MEAN; (N, dim) for NONE.
        """
        _check_batch(indices, offsets, per_sample_weights, self.pooling_mode)
        device = self.groups[0].rows.device
        indices = indices.to(device=device, dtype=torch.int64).contiguous()
        offsets = offsets.to(device=device, dtype=torch.int64).contiguous()
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device=device,
                                                       dtype=torch.float32).contiguous()
        out = None
        for g in self.groups:
            part = frozen_lookup(indices, offsets, per_sample_weights, g.index(),
                                 g.row_of_slot, g.rows, g.dim, g.feature_tids, g.feature_cols,
                                 g.init_ints, g.init_floats, 128, self.out_cols,
                                 POOLING_CODES[self.pooling_mode.name])
            out = part if out is None else out + part
        return out if self.output_dtype == torch.float32 else out.to(self.output_dtype)


def _tables_dtype(options, names) -> torch.dtype:
    """The row dtype of every table; ``ValueError`` when they differ."""
    dtypes = {o.row_dtype for o in options}
    if len(dtypes) > 1:
        raise ValueError(f"tables {names} store rows of {sorted(map(str, dtypes))}: give the "
                         f"twin one dtype")
    return dtypes.pop()


def _check_tables(options, names, features, rows: Rows) -> None:
    """Raises ``ValueError`` naming what is wrong with the tables, features or rows."""
    if not options:
        raise ValueError("table_options must name at least one table")
    if len(names) != len(options) or len(set(names)) != len(names):
        raise ValueError("table_names must be unique, one per table")
    if not features or not all(0 <= t < len(options) for t in features):
        raise ValueError(f"feature_table_map entries must be in [0, {len(options)})")
    for name, o in zip(names, options):
        if name not in rows:
            raise ValueError(f"no rows given for table {name!r} (rows hold {sorted(rows)})")
        keys, embeddings = rows[name]
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise ValueError(f"table {name!r}: keys must be (n,) int64, got "
                             f"{tuple(keys.shape)} {keys.dtype}")
        if tuple(embeddings.shape) != (keys.numel(), o.dim) or \
                not embeddings.is_floating_point():
            raise ValueError(f"table {name!r}: embeddings must be ({keys.numel()}, {o.dim}) "
                             f"floating point, got {tuple(embeddings.shape)} {embeddings.dtype}")


def _check_batch(indices, offsets, weights, pooling: DynamicEmbPoolingMode) -> None:
    """Raises for a batch of the wrong types or shapes (the op checks the data)."""
    check_batch_types(indices, offsets, weights, "" if pooling == DynamicEmbPoolingMode.SUM
                      else f"this module uses {pooling.name}")
    if weights is not None and weights.dim() != 1:
        raise ValueError(f"per_sample_weights must be 1-D like indices, got shape "
                         f"{tuple(weights.shape)}")
