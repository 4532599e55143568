"""Hot-row replicas with bounded staleness (``replica_staleness`` s > 0; docs/ARCHITECTURE.md).

Every rank keeps a write-back copy of every replicated row (``StaleCopies``), read with no
exchange and moved each training step by the table's optimizer on this rank's window
gradients. At the first lookup after s training steps (the same batch everywhere) the
window's gradients go to the owners, which apply them in one fused optimizer step, and every
rank pulls the rows and optimizer states again: a copy lags its owner by at most s - 1 steps
of the other ranks' gradients. Checkpoints flush first and loads drop the copies
(``PendingUpdates``); a flush is a training call of the owners' tables (it advances
``train_steps`` and clocks by one). Only optimizers whose window sum is one step are allowed
(``DELAYED_OPTIMIZERS``); Adam (bias correction counts calls) and weight decay (once per
window) are refused.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.checkpoint.tables import ShardKernel
from dynamicemb.embedding import BatchedDynamicEmbeddingTables
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb.shard.lookup import DynamicEmbGroupedEmbeddingsLookup
from dynamicemb.shard.replicas import ReplicaBatch, ReplicaSet, append_owned, replica_sets

__all__ = ["DELAYED_OPTIMIZERS", "StaleCopies", "attach_copies", "flush_replicas"]

#: Optimizers whose update of a row is defined for gradients applied late (module docstring).
DELAYED_OPTIMIZERS = (DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.EXACT_ADAGRAD,
                      DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD)


def _tables_of(lookup: nn.Module) -> Dict[str, BatchedDynamicEmbeddingTables]:
    """The module holding each dynamic table of a lookup on this rank."""
    return {name: sub.emb_module for sub in lookup.modules() if isinstance(sub, ShardKernel)
            for name in sub.emb_module.table_names}


def _check_optimizers(tables: Dict[str, BatchedDynamicEmbeddingTables], names: List[str],
                      staleness: int) -> None:
    for name in names:
        args = tables[name].optimizer_args(name)
        if args.optimizer not in DELAYED_OPTIMIZERS:
            raise ValueError(
                f"table {name!r}: replica_staleness={staleness} applies a window's gradients "
                f"late, defined for SGD, Adagrad and row-wise Adagrad; {args.optimizer.name} is "
                f"refused (its bias correction counts optimizer calls and its moments one "
                f"gradient per step): use replica_staleness=0 or one of those")
        if args.weight_decay:
            raise ValueError(
                f"table {name!r}: replica_staleness={staleness} with weight_decay="
                f"{args.weight_decay} would decay a replicated row once per window, not at "
                f"every step that uses it: use weight_decay=0 or replica_staleness=0")


class StaleCopies:
    """Copies of a sharding's replicated rows, their pending gradients and counts
    (``replicas.stale`` of a ``ReplicaSet`` with staleness > 0).

    Raises:
        ValueError: a replicated table's optimizer is not in ``DELAYED_OPTIMIZERS`` or has
            weight decay.
    """

    def __init__(self, replicas: ReplicaSet, lookup: DynamicEmbGroupedEmbeddingsLookup,
                 dim: int) -> None:
        self.replicas = replicas
        self.staleness = replicas.staleness
        self.lookup = lookup
        self.dim = dim
        self._tables = _tables_of(lookup)
        _check_optimizers(self._tables, [t.name for t in replicas.tables], self.staleness)
        self._state_width = max([self._tables[t.name].optimizer_state_dim(t.name)
                                 for t in replicas.tables], default=0)
        self._bounds: List[int] = [0] * (len(replicas.tables) + 1)  # slots of each table
        self._traffic = [0, 0, 0]  # what take_traffic reports
        self.drop()

    def drop(self) -> None:
        """Forgets the copies, pending gradients and counts (local)."""
        self.rows: Optional[torch.Tensor] = None  # (S, dim) leaf; None: pull first
        self.base: Optional[torch.Tensor] = None  # (S, dim + state floats) pulled rows and states
        self.pending: Optional[torch.Tensor] = None  # (S, dim) gradients applied to the copies
        self.stored: Optional[torch.Tensor] = None  # (S,) bool: the owner held the id at the pull
        self._eval_init: Optional[torch.Tensor] = None  # (S, dim) eval rows of ids not stored
        self.counts = torch.zeros(self.replicas.num_slots, dtype=torch.int64)
        self.steps = 0  # training lookups since the last sync, the same on every rank

    def take_traffic(self) -> Tuple[int, int, int]:
        """(counts all-reduced, rows pulled, gradient rows pushed) since the last call."""
        traffic, self._traffic = tuple(self._traffic), [0, 0, 0]
        return traffic

    # ----------------------------------------------------------- a batch
    def serve(self, batch: Optional[ReplicaBatch], features: KeyedJaggedTensor) -> torch.Tensor:
        """Owner side of a batch: syncs when a window is over (or the copies are gone),
        looks up the received ids and sets ``batch.rows`` to the copies (all S slots). A training
        lookup (grad enabled, module training) counts one step. Returns (received ids, dim) rows."""
        if batch is None:
            raise RuntimeError("replicas: the lookup needs its batch's ReplicaBatch (run the "
                               "module through the dynamic sharded collections)")
        if self.rows is None or self.steps >= self.staleness:
            self.sync()
        else:
            self._update_copies()
        rows = DynamicEmbGroupedEmbeddingsLookup.forward(self.lookup, features).view(-1, self.dim)
        training = torch.is_grad_enabled() and self.lookup.training
        if training:
            self.steps += 1
            self.counts += batch.local_counts
        batch.active_slots = torch.arange(self.replicas.num_slots)
        batch.rows = self.rows if training else self._eval_copies()
        batch.traffic = self.take_traffic()
        return rows

    def _eval_copies(self) -> torch.Tensor:
        """(S, dim) eval rows: the copies, but the eval initializer's row for ids not stored at
        the pull and not trained here since (what eval without replicas reads)."""
        rows = self.rows.detach()
        unseen = ~self.stored & (self.counts == 0)
        if not bool(unseen.any()):
            return rows
        if self._eval_init is None:  # once per pull: the rows depend on the ids only
            self._eval_init = torch.zeros_like(rows)
            for t, table in enumerate(self.replicas.tables):
                first, last = self._bounds[t], self._bounds[t + 1]
                slots = torch.nonzero(~self.stored[first:last]).flatten() + first
                if slots.numel():
                    self._eval_init[slots] = self._tables[table.name].read_rows(
                        table.name, self.replicas.ids[slots], train=False).cpu()
        return torch.where(unseen[:, None], self._eval_init, rows)

    # ------------------------------------------------------------ a sync
    def sync(self) -> None:
        """Flushes the pending gradients, then pulls every replicated row (a collective)."""
        self.flush()
        self._pull()

    def flush(self) -> None:
        """Applies the pending gradients to the owner rows and drops the copies; a collective
        only when a step is pending (the step count is the same on every rank)."""
        if self.steps == 0:
            return
        replicas, pg = self.replicas, self.replicas.pg
        counts = self.counts.clone()
        if counts.numel():
            dist.all_reduce(counts, group=pg)
        active = torch.nonzero(counts > 0).flatten()  # (A,) the same on every rank
        self._traffic[0] += counts.numel()
        if active.numel():
            grads = self._window_gradients()[active]
            total = self._push(grads, replicas.owners[active])
            owned = active[replicas.owners[active] == replicas.rank]
            self._apply_owned(owned, counts[owned], total)
            self._traffic[2] += active.numel()
        self.drop()

    def _window_gradients(self) -> torch.Tensor:
        """(S, dim) this rank's gradients of the copies since the last sync."""
        total = torch.zeros(self.replicas.num_slots, self.dim)
        if self.pending is not None:
            total += self.pending
        if self.rows is not None and self.rows.grad is not None:
            total += self.rows.grad
        return total

    def _update_copies(self) -> None:
        """Adds ``rows.grad`` to ``pending``; each copy becomes its pulled row after one optimizer
        step on ``pending``."""
        grad = self.rows.grad
        if grad is None:
            return
        self.pending = grad.clone() if self.pending is None else self.pending.add_(grad)
        self.rows.grad = None
        with torch.no_grad():
            for t, table in enumerate(self.replicas.tables):
                first, last = self._bounds[t], self._bounds[t + 1]
                if last > first:
                    module = self._tables[table.name]
                    width = self.dim + module.optimizer_state_dim(table.name)
                    values = self.base[first:last, :width].to(module.device, copy=True)
                    module.step_rows(table.name, values,
                                     self.pending[first:last].to(module.device).contiguous())
                    self.rows[first:last] = values[:, :self.dim].cpu()

    def _push(self, grads: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        """Sends (A, dim) gradients to their ``owners`` (A,); returns the sums of this rank's ids
        in active order (parts divided as TorchRec divides, summed in rank order)."""
        world_size, rank = self.replicas.world_size, self.replicas.rank
        sizes = torch.bincount(owners, minlength=world_size).tolist()
        by_owner = torch.argsort(owners, stable=True)
        mine = sizes[rank]
        received = grads.new_empty(world_size * mine, self.dim)
        dist.all_to_all_single(received, grads[by_owner].contiguous(), [mine] * world_size,
                               sizes, group=self.replicas.pg)
        parts = received.view(world_size, mine, self.dim)
        if get_gradient_division():
            parts = parts / world_size
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def _apply_owned(self, slots: torch.Tensor, counts: torch.Tensor, grads: torch.Tensor) -> None:
        """One training call of the lookup on the owned ``slots`` whose backward applies ``grads``
        (whatever the module's mode)."""
        if slots.numel() == 0:
            return
        names = self.replicas.feature_names
        empty = KeyedJaggedTensor(keys=names, values=torch.empty(0, dtype=torch.int64),
                                  lengths=torch.zeros(len(names), dtype=torch.int32),
                                  weights=torch.empty(0), stride=1)
        features, appended = append_owned(empty, self.replicas, slots, counts)
        was_training = self.lookup.training
        self.lookup.train(True)
        try:
            with torch.enable_grad():
                rows = DynamicEmbGroupedEmbeddingsLookup.forward(self.lookup, features)
                rows = rows.view(-1, self.dim)
                grad = torch.zeros_like(rows)
                grad[appended] = grads
                rows.backward(grad)
        finally:
            self.lookup.train(was_training)

    def _pull(self) -> None:
        """Sets every copy and state to its owner's row and optimizer state, and ``stored``."""
        replicas = self.replicas
        world_size, num_slots = replicas.world_size, replicas.num_slots
        width = self.dim + self._state_width + 1  # the last column: stored (1.0) or not
        values = torch.zeros(num_slots, width)
        if num_slots:
            mine = torch.nonzero(replicas.owners == replicas.rank).flatten()  # ascending slots
            owned = self._read(mine)
            sizes = torch.bincount(replicas.owners, minlength=world_size).tolist()
            received = owned.new_empty(num_slots, width)
            dist.all_to_all_single(received, owned.repeat(world_size, 1), sizes,
                                   [mine.numel()] * world_size, group=replicas.pg)
            values[torch.argsort(replicas.owners, stable=True)] = received
            self._traffic[1] += num_slots
        self.base = values[:, :-1]
        self.stored = values[:, -1] > 0
        self._eval_init = None
        self.rows = values[:, :self.dim].clone().requires_grad_()
        self.pending = None
        self._bounds = torch.cumsum(torch.bincount(
            replicas.table_of_slot, minlength=len(replicas.tables)), 0).tolist()
        self._bounds.insert(0, 0)

    def _read(self, slots: torch.Tensor) -> torch.Tensor:
        """(len(slots), dim + state width + 1): owner rows, optimizer states (zero-padded) and
        1.0 where the owner stores the id (0.0: what an insert would store)."""
        replicas = self.replicas
        parts = []
        tables = replicas.table_of_slot[slots]
        for t, table in enumerate(replicas.tables):  # slots are in table order
            ids = replicas.ids[slots[tables == t]]
            if ids.numel():
                module = self._tables[table.name]
                part = torch.zeros(ids.numel(), self.dim + self._state_width + 1)
                part[:, :self.dim] = module.read_rows(table.name, ids).cpu()
                states = module.read_optimizer_states(table.name, ids).cpu()
                part[:, self.dim:self.dim + states.shape[1]] = states
                part[:, -1] = module.holds(table.name, ids).cpu().float()
                parts.append(part)
        return torch.cat(parts) if parts else torch.zeros(0, self.dim + self._state_width + 1)


def attach_copies(replicas: Optional[ReplicaSet], lookup: DynamicEmbGroupedEmbeddingsLookup,
                  dim: int) -> None:
    """Gives ``replicas`` their ``StaleCopies`` when its staleness is > 0."""
    if replicas is not None and replicas.staleness > 0:
        replicas.stale = StaleCopies(replicas, lookup, dim)


def flush_replicas(module: nn.Module) -> int:
    """Applies every stale replica's pending gradients in ``module`` to the owner rows.

    A collective: call it on every rank at the same point between steps, e.g. before
    ``export_keys_values`` or ``import_keys_values`` (checkpoints and ``refresh_replicas`` flush
    by themselves). Returns the number of shardings whose pending steps were applied.
    """
    flushed = 0
    for replicas in replica_sets(module):
        if replicas.stale is not None and replicas.stale.steps:
            replicas.stale.flush()
            flushed += 1
    return flushed
