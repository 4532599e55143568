"""A frozen table group: the training table's hash index, built once and then only
read, over rows stored compactly in ``dynamicemb.types.ROW_DTYPES`` with a slot -> row
map. A row is the embedding alone, ``RowFormat(dtype, dim, 0)``: whole 4-byte words, so
a 16-bit row of an odd dim carries one element of padding, and the kernels read the
rows in place.
"""

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from dynamicemb.embedding.initialization import init_spec
from dynamicemb.ops import for_device
from dynamicemb.ops.interface import RowFormat, ScoreRule, num_buckets_for
from dynamicemb.options import DynamicEmbTableOptions

__all__ = ["FrozenGroup"]

#: Slots per bucket and target load of a frozen index (loads land in [0.375, 0.75]).
_BUCKET_CAPACITY = 128
_LOAD = 0.75


def build_index(keys: torch.Tensor, tids: torch.Tensor, num_tables: int,
                names: Sequence[str]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """A read-only hash index of (table id, key) pairs.

    Args:
        keys (Tensor): (n,) int64, unique per table.
        tids (Tensor): (n,) int16 local table ids of ``num_tables`` (named ``names``).

    Returns:
        The index arrays (``frozen_lookup``'s ``index``) and (C + 1,) int64 row of
        each slot (row i: the i-th key); -1 where empty and last, for an absent key.

    Raises:
        ValueError: a key given twice for one table (a damaged or merged dump).
    """
    ops = for_device(keys.device)
    n = keys.numel()
    buckets = num_buckets_for(max(1, -(-n * 4 // 3)), _BUCKET_CAPACITY)
    memory = ops.new_table(num_buckets=buckets, max_num_buckets=buckets * 16,
                           bucket_capacity=_BUCKET_CAPACITY, value_dim=0,
                           value_dtype=torch.float32, device=keys.device)
    done = None
    while n:  # a pass; a full bucket undoes it and doubles the index
        outcomes = torch.zeros(5, dtype=torch.int64, device=keys.device)
        size = torch.zeros(1, dtype=torch.int64, device=keys.device)
        done = ops.upsert(memory=memory, keys=keys, table_ids=tids, scores=None,
                          rule=ScoreRule.CLOCK, evicts=False, one_table=num_tables == 1,
                          outcomes=outcomes, size=size)
        hits, _, _, failed, _ = outcomes.tolist()
        if hits:
            twice = done.status.eq(0).nonzero()[0, 0]
            raise ValueError(f"table {names[int(tids[twice])]!r} has key {int(keys[twice])} "
                             f"more than once")
        if not failed:
            break
        if not memory.can_grow:  # 16 doublings past a 3/4 load: never for distinct keys
            raise RuntimeError(f"{failed} keys found no slot in the frozen index")
        ops.undo_upsert(memory=memory, upserted=done)
        ops.grow(memory=memory)
    row_of_slot = torch.full((memory.capacity + 1,), -1, dtype=torch.int64, device=keys.device)
    if done is not None:
        row_of_slot[done.slots] = torch.arange(n, dtype=torch.int64, device=keys.device)
    keys_scores = memory.meta[0].as_strided((memory.capacity, 2), (2, 1))
    keys_scores[:, 1] = 0  # scores are not served
    return [keys_scores, *memory.meta[2:]], row_of_slot


class FrozenGroup(nn.Module):
    """The frozen rows of tables of one dim, looked up by ``frozen_lookup``.

    Args:
        names, options: the group's tables (local table id = position).
        rows: table name -> (keys (n,) int64, embeddings (n, dim) floating point).
        dtype: the stored rows' dtype (``ROW_DTYPES``); embeddings of another dtype are
            rounded to nearest once, as ``RowFormat.pack`` does.
        feature_tables: each feature's table name (all of the module's features).
        feature_cols: each feature's first output column, -1 for other groups'.

    Attributes:
        rows: (R, P) ``dtype``, the words of ``row_format`` (P: ``dim``, or ``dim + 1``
            for 16-bit rows of an odd ``dim``; ``embeddings()`` leaves the padding out).
    """

    def __init__(self, names: Sequence[str], options: Sequence[DynamicEmbTableOptions],
                 rows: Dict[str, Tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
                 feature_tables: Sequence[str], feature_cols: Sequence[int],
                 device: torch.device) -> None:
        super().__init__()
        self.names = list(names)
        self.dim = options[0].dim
        self.row_format = RowFormat(dtype, self.dim, 0)
        keys = [rows[n][0].to(device, torch.int64).reshape(-1) for n in names]
        tids = torch.cat([torch.full((k.numel(),), t, dtype=torch.int16, device=device)
                          for t, k in enumerate(keys)])
        index, row_of_slot = build_index(torch.cat(keys), tids, len(names), self.names)
        for i, name in enumerate(("index_keys_scores", "index_table_ids", "index_digests",
                                  "index_occupied", "index_pinned")):
            self.register_buffer(name, index[i])
        self.register_buffer("row_of_slot", row_of_slot)
        embeddings = torch.cat([rows[n][1].to(device) for n in names])
        self.register_buffer("rows", self.row_format.pack(embeddings).view(dtype))
        local = {n: t for t, n in enumerate(names)}
        self.register_buffer("feature_tids", torch.tensor(
            [local.get(n, 0) for n in feature_tables], dtype=torch.int16, device=device))
        self.register_buffer("feature_cols", torch.tensor(feature_cols, dtype=torch.int64,
                                                          device=device))
        ints, floats = init_spec(names, options)
        self.register_buffer("init_ints", ints.to(device))
        self.register_buffer("init_floats", floats.to(device))

    def index(self) -> List[torch.Tensor]:
        """The index arrays in ``frozen_lookup``'s order."""
        return [self.index_keys_scores, self.index_table_ids, self.index_digests,
                self.index_occupied, self.index_pinned]

    def embeddings(self) -> torch.Tensor:
        """(R, dim) ``rows`` without their padding, a view."""
        return self.rows[:, :self.dim]

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes of the index (metadata and slot -> row map) and of the rows."""
        index = sum(t.numel() * t.element_size() for t in self.index() + [self.row_of_slot])
        return {"index": index, "rows": self.rows.numel() * self.rows.element_size()}
