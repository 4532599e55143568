"""``incremental_dump``: the rows touched since a score threshold, for serving."""

from typing import Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from dynamicemb.checkpoint._collective import Collective
from dynamicemb.checkpoint.tables import local_tables, pending_updates

__all__ = ["incremental_dump"]


def incremental_dump(
    model: nn.Module,
    score_threshold: Union[int, Mapping[str, int]],
    pg: Optional[dist.ProcessGroup] = None,
) -> Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Dict[str, int]]:
    """The rows of every dynamic table scoring at least the threshold, and the
    thresholds to pass next time: with LRU or STEP scores, exactly the rows created or
    updated since the previous call. A collective over ``pg``.

    Args:
        model: a sharded or unsharded model with dynamic tables (LRU or STEP).
        score_threshold: one threshold for every table, or one per table name
            (tables not named are skipped). 0 returns every row.
        pg: the ranks holding the model (see ``DynamicEmbDump``).

    Returns:
        ``(rows, next_threshold)``: ``rows[table] = (keys (n,) int64, embeddings
        (n, dim) in the table's dtype)`` of every rank in rank order (the stored rows,
        bit for bit: float16/bfloat16 tables give float16/bfloat16 rows);
        ``next_threshold[table]`` the score the next training batch gives (the smallest
        over ranks).

    Example::

        rows, threshold = incremental_dump(model, 0)          # everything
        ...train...
        fresh, threshold = incremental_dump(model, threshold)  # rows touched since
    """
    for pending in pending_updates(model):  # owner rows only, with nothing pending
        pending.flush_pending()
    group = Collective(pg)
    tables = local_tables(model)
    if not isinstance(score_threshold, Mapping):
        score_threshold = {name: int(score_threshold) for name in tables}
    local: Dict[str, Tuple[torch.Tensor, torch.Tensor, int]] = {}
    error = None
    try:
        for module in {id(t.module): t.module for t in tables.values()}.values():
            module.flush()
        for name, table in sorted(tables.items()):
            if name not in score_threshold:
                continue
            chunks = list(table.module.iter_keys_values(
                name, 1 << 16, min_score=int(score_threshold[name])))
            keys = torch.cat([c.keys for c in chunks])
            rows = torch.cat([c.embeddings for c in chunks])
            local[name] = (keys.cpu(), rows.cpu(), table.module.next_score(name))
    except ValueError as err:
        error = f"rank {group.rank}: {err}"
    group.agree(error)
    rows: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    thresholds: Dict[str, int] = {}
    for per_rank in group.all_gather(local):
        for name, (keys, embeddings, next_score) in per_rank.items():
            if name in rows:
                old_keys, old_rows = rows[name]
                rows[name] = (torch.cat([old_keys, keys]), torch.cat([old_rows, embeddings]))
                thresholds[name] = min(thresholds[name], next_score)
            else:
                rows[name], thresholds[name] = (keys, embeddings), next_score
    return rows, thresholds
