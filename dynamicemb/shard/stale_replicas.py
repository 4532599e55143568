"""Hot-row replicas with bounded staleness (``replica_staleness`` s > 0).

The replicated ids are those of ``replicas.py`` (a ``ReplicaSet``, chosen by
``refresh_replicas``) and leave the all-to-all as there. What differs is where their
rows come from and when their gradients reach the owners:

- Every rank keeps a copy of every replicated row (``StaleCopies.rows``, (S, dim), a
  leaf tensor; ``base``: the rows and optimizer states pulled). A lookup of a replicated id
  reads the copy, with no exchange; the backward puts the step's gradients of the
  copies in ``rows.grad`` and the lookup adds the step's occurrence counts to
  ``counts``. The next lookup adds them to the window's ``pending`` gradients and
  sets each copy to the pulled row moved by the table's optimizer step (its
  kernel, ``step_rows``) for
  ``pending`` from the pulled state (a write-back copy, as HET's cache: a rank reads
  its own updates at once, the other ranks' at the next sync; and the step the owner
  will apply if the other ranks' gradients match this rank's).
- A sync runs at the lookup of the first batch after s counted steps (training
  lookups since the last sync: the same number on every rank, so every rank runs
  the collectives at the same batch). The counts are all-reduced (one int64 per
  replicated id); each rank sends its accumulated gradients of the ids some rank
  used (A of them) to their owners (one ``all_to_all_single``), which divide them by
  the world size when TorchRec divides (as the all-to-all's backward does), sum
  them in rank order and apply the sums in one training call of their lookup (the
  ids with the window's counts as frequencies, then the fused backward: one
  optimizer step on those rows). Then every owner reads its replicated rows and
  their optimizer states (``read_rows``, ``read_optimizer_states``: nothing changes;
  an id it has not stored reads the initializer's row and the initial state, what
  an insert stores, and is flagged not stored) and sends them to every rank (one
  ``all_to_all_single``), which replaces its copies and states. An eval lookup reads
  the copies, but the eval initializer's row for an id not stored at the pull and
  not trained on this rank since: what eval without replicas reads.

Between syncs no rank changes the owner row of a replicated id (every rank, the
owner too, reads and trains its copy): with SGD the owner row after a sync is the
row before minus the learning rate times the window's summed gradient, the
gradients of each window applied at its end, and rank r's copy during a window is
that row minus the learning rate times r's own gradients so far in the window (not
divided by the world size: each rank's gradients estimate the mean the owner
applies). With Adagrad the copy is the same one step on r's window sum, so a copy
never runs ahead of what the owner's windowed step can follow. A copy lags
its owner by at most s - 1 steps of the other ranks' gradients. Per s steps the
replicas cost one count all-reduce, one push of A gradient rows and one pull of S
rows (and their optimizer states) to the W - 1 other ranks; at staleness 0 the rows
and gradients of the A ids in use cross every step.

Checkpoints apply pending gradients first and loads drop the copies (the lookups
are ``PendingUpdates``: ``DynamicEmbDump``, ``incremental_dump``, the state dict
hooks, ``DynamicEmbLoad``); ``refresh_replicas`` flushes before changing the ids;
``flush_replicas(model)`` flushes by hand (before ``export_keys_values``). The next
lookup after a flush, a refresh or a load pulls the copies again. A flush is a
training call of the owners' tables: it advances their ``train_steps`` and clocks
by one, as a batch does.

Optimizers: a delayed update is defined where the update of a row depends only on
the gradients it is given: SGD (a window's gradients applied as one sum move the
row by exactly their sum) and Adagrad / row-wise Adagrad (their accumulator sums
the squares of the gradients applied: the window's sum is one Adagrad step, as a
parameter server applies pushed gradients). Adam is refused: its bias correction
counts the table's optimizer calls (every flush is one more, for every row) and its
moments assume one gradient per step. Weight decay is refused too: it would decay a
replicated row once per window, not at every step that uses it.
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
    (one per ``ReplicaSet`` with staleness > 0; ``replicas.stale``).

    Args:
        replicas: the sharding's replicated ids (``replicas.staleness`` > 0).
        lookup: the sharding's lookup on this rank (its grouped forward applies
            the owners' updates; its kernels hold the owner rows).
        dim: the sharding's embedding width.

    Raises:
        ValueError: a replicated table's optimizer cannot apply gradients late
            (``DELAYED_OPTIMIZERS``, no weight decay).
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
        """Forgets the copies, the pending gradients and counts (local; after a
        flush, a change of the ids or before rows are loaded)."""
        self.rows: Optional[torch.Tensor] = None  # (S, dim) leaf; None: pull first
        self.base: Optional[torch.Tensor] = None  # (S, dim + state floats) pulled rows and states
        self.pending: Optional[torch.Tensor] = None  # (S, dim) gradients applied to the copies
        self.stored: Optional[torch.Tensor] = None  # (S,) bool: the owner held the id at the pull
        self._eval_init: Optional[torch.Tensor] = None  # (S, dim) eval rows of ids not stored
        self.counts = torch.zeros(self.replicas.num_slots, dtype=torch.int64)
        self.steps = 0  # training lookups since the last sync, the same on every rank

    def take_traffic(self) -> Tuple[int, int, int]:
        """(counts all-reduced, rows pulled, gradient rows pushed) since the last call
        (``IdCounters.add_replicas``)."""
        traffic, self._traffic = tuple(self._traffic), [0, 0, 0]
        return traffic

    # ----------------------------------------------------------- a batch
    def serve(self, batch: Optional[ReplicaBatch], features: KeyedJaggedTensor) -> torch.Tensor:
        """Owner side of a batch: syncs when a window is over (or the copies are
        gone), looks up the received ids, and gives the batch the copies
        (``batch.rows``, all S slots). A training lookup (grad enabled, module in
        training) counts one step and adds the batch's counts.

        Returns:
            (received ids, dim): the rows of the received ids, in their order.
        """
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
        """(S, dim) what an eval lookup reads of each replicated id: its copy, but for
        an id its owner had not stored at the pull and this rank has not trained
        since, the eval initializer's row (what eval without replicas reads; the
        pulled copy holds the row an insert would store)."""
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
        """Applies the pending gradients (if any step is pending), then pulls every
        replicated row from its owner. A collective of the sharding's ranks."""
        self.flush()
        self._pull()

    def flush(self) -> None:
        """Applies the pending gradients to the owner rows and drops the copies (a
        collective when a step is pending, nothing otherwise: the step count is the
        same on every rank)."""
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
        """(S, dim) this rank's gradients of the copies since the last sync: those
        applied to the copies and the last step's (not applied yet)."""
        total = torch.zeros(self.replicas.num_slots, self.dim)
        if self.pending is not None:
            total += self.pending
        if self.rows is not None and self.rows.grad is not None:
            total += self.rows.grad
        return total

    def _update_copies(self) -> None:
        """Moves the last step's gradients of the copies (``rows.grad``) to
        ``pending`` and sets each copy to its pulled row after one step of its
        table's optimizer on ``pending`` from the pulled state."""
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
        """Sends each rank's gradients (A, dim) of the active ids to their owners
        (``owners`` (A,)); returns the sums of this rank's ids (in active order),
        each rank's part divided by the world size when TorchRec divides, summed in
        rank order (as the owner's kernel sums rows the all-to-all brings)."""
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
        """One training call of the lookup on the owned ids of ``slots`` (frequencies
        ``counts``) whose backward gives their rows ``grads``: the fused optimizer
        applies each sum once. The lookup trains for it whatever its mode."""
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
        """Every rank's copies and states = the owners' rows and optimizer states of
        every replicated id, and whether the owner stores it."""
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
        """(len(slots), dim + state width + 1) the owner rows and optimizer states of
        this rank's ``slots`` (ascending; states zero-padded to the widest), then 1.0
        where the owner stores the id (0.0: the row and state an insert would store)."""
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
    """Gives a sharding's replicas their copies (``replicas.stale``) when its tables
    ask for staleness > 0; nothing otherwise."""
    if replicas is not None and replicas.staleness > 0:
        replicas.stale = StaleCopies(replicas, lookup, dim)


def flush_replicas(module: nn.Module) -> int:
    """Applies the gradients every stale replica of ``module`` (a
    ``DistributedModelParallel`` or anything holding sharded collections) holds
    for its owner; the next lookup pulls the copies again. A collective: call it on
    every rank at the same point between steps (``DynamicEmbDump``, the state
    dict, ``incremental_dump`` and ``refresh_replicas`` do it themselves; call it
    before ``export_keys_values`` or ``import_keys_values``).

    Returns:
        The number of shardings whose pending steps were applied.
    """
    flushed = 0
    for replicas in replica_sets(module):
        if replicas.stale is not None and replicas.stale.steps:
            replicas.stale.flush()
            flushed += 1
    return flushed
