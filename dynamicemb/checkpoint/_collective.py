"""The process-group calls a checkpoint makes, and a single-process stand-in."""

from typing import Any, List, Optional

import torch.distributed as dist

from dynamicemb.checkpoint.format import CheckpointError

__all__ = ["Collective"]


class Collective:
    """The ranks of ``pg`` (None: the default group if initialized, else this process)."""

    def __init__(self, pg: Optional[dist.ProcessGroup] = None) -> None:
        self.pg = pg
        self.active = dist.is_available() and dist.is_initialized()
        if pg is not None and not self.active:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        self.rank = dist.get_rank(pg) if self.active else 0
        self.world_size = dist.get_world_size(pg) if self.active else 1

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.active:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.pg, 0)
                                   if self.pg is not None else 0, group=self.pg)
        return box[0]

    def agree(self, error: Optional[str]) -> None:
        """Raises ``CheckpointError`` on every rank if any rank passes an error."""
        errors = [e for e in self.all_gather(error) if e is not None]
        if errors:
            raise CheckpointError(errors[0] if len(set(errors)) == 1 else "; ".join(sorted(set(errors))))
