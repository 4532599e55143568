"""Rank bodies of the bounded-staleness replica tests (spawned; importable, no pytest).

A model with ``replica_staleness`` s > 0 trains with SGD on per-rank power-law
batches whose every id was imported before training (rows drawn from a seed), so
the whole training can be replayed in plain float64 tensors on every rank
(``WindowReference``): each step's gradients of rows that are not replicated are
applied at that step, those of replicated rows are summed over each window of s
steps and applied at its end (and at a refresh, and at the end). Outputs at every
step, owner rows after the flush a checkpoint does, and the rows a checkpoint
loads into a model without replicas are compared with it.
"""

from typing import Dict, List

import torch
import torch.distributed as dist

from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.shard import flush_replicas, get_dynamic_tables, owner_rank, refresh_replicas
from dynamicemb.shard.replicas import replica_sets
from dynamicemb_testing.replica_workers import DIM, OPTIMIZERS, build, power_law_batch

# name -> (rows, features, sharding, replicas), every one dynamic and row-wise
TABLES = {"s_hot": (16384, ["a", "b"], "row_wise", 8), "s_frac": (16384, ["c"], "row_wise", 0.05),
          "s_plain": (16384, ["d"], "row_wise", 0)}
TARGET = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4}  # loss: sum of (output - TARGET[feature])^2
# every id power_law_batch draws: 0..1999, and -i - 7 for i % 3 == 0 (features b, c)
KEYS = torch.cat([torch.arange(2000), -torch.arange(0, 2000, 3) - 7])
HOT = {"s_hot": [0, 1, 2, 3, 4, 5, 6, 7], "s_frac": [0, 1, 2, -7, 3]}
LATER_HOT = {"s_hot": [0, 1, 8, -10, 10**15], "s_frac": [4, 5, -7]}  # after the refresh
REFRESH_AT = 4
# the model sums in float32 (its kernel, dedup, the division by the world size); the
# reference in float64: rows ~0.1-1 after a few SGD steps
TOLERANCE = {"atol": 2e-5, "rtol": 1e-5}


def initial_rows(name: str) -> torch.Tensor:
    """(len(KEYS), DIM) float32: a table's rows before training."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return 0.1 * torch.randn(KEYS.numel(), DIM, generator=g)


def preload(dmp, world_size: int, rank: int) -> None:
    """Every rank imports the rows of the ``KEYS`` it owns."""
    mine = owner_rank(KEYS, world_size) == rank
    for name, module in get_dynamic_tables(dmp).items():
        module.import_keys_values(name, KEYS[mine], initial_rows(name)[mine])


def _outputs(out, pooled: bool) -> Dict[str, torch.Tensor]:
    if pooled:
        return {f: v for f, v in out.to_dict().items()}
    return {f: out[f].values() for f in out.keys()}


def train_step(dmp, step: int, rank: int, pooled: bool) -> Dict[str, torch.Tensor]:
    out = _outputs(dmp(power_law_batch(step, rank, TABLES)), pooled)
    sum(((v - TARGET[f]) ** 2).sum() for f, v in out.items()).backward()
    return {f: v.detach() for f, v in out.items()}


class WindowReference:
    """SGD in float64 on every table's rows: gradients of replicated rows summed
    over each window and applied at its end, the others at every step; gradients
    divided by the world size (TorchRec's gradient division). During a window rank
    r reads a replicated row as the row minus the learning rate times r's own
    gradients of it so far in the window (its write-back copy; not divided).

    Args:
        world_size: ranks whose batches make a step.
        lr: SGD's learning rate.
        pooled: SUM-pooled bags (an EBC) instead of one row per id (an EC).
        staleness: the window.
    """

    def __init__(self, world_size: int, lr: float, pooled: bool, staleness: int) -> None:
        self.world_size, self.lr, self.pooled, self.staleness = world_size, lr, pooled, staleness
        self.rows = {n: dict(zip(KEYS.tolist(), initial_rows(n).double())) for n in TABLES}
        self.table_of = {f: n for n, (_, features, _, _) in TABLES.items() for f in features}
        self.hot: Dict[str, set] = {n: set() for n in TABLES}
        self.pending: Dict[str, Dict[int, torch.Tensor]] = {n: {} for n in TABLES}
        # per rank: its own gradients of replicated rows in the window (its copies)
        self.local: List[Dict[str, Dict[int, torch.Tensor]]] = [{n: {} for n in TABLES}
                                                               for _ in range(world_size)]
        self.since = 0

    def flush(self) -> None:
        for name, grads in self.pending.items():
            for key, g in grads.items():
                self.rows[name][key] -= self.lr * g
            grads.clear()
        for mine in self.local:
            for grads in mine.values():
                grads.clear()
        self.since = 0

    def _read(self, rank: int, name: str, key: int) -> torch.Tensor:
        """The row ``rank`` reads: its copy where the key is replicated."""
        own = self.local[rank][name].get(key) if key in self.hot[name] else None
        return self.rows[name][key] if own is None else self.rows[name][key] - self.lr * own

    def set_hot(self, hot: Dict[str, List[int]]) -> None:
        self.flush()
        self.hot = {n: set(hot.get(n, [])) for n in TABLES}

    def step(self, step: int, rank: int) -> Dict[str, torch.Tensor]:
        """Trains one step of every rank's batch; returns ``rank``'s outputs."""
        if self.since >= self.staleness:
            self.flush()
        grads: Dict[str, Dict[int, torch.Tensor]] = {n: {} for n in TABLES}
        own: List[Dict[str, Dict[int, torch.Tensor]]] = [{n: {} for n in TABLES}
                                                         for _ in range(self.world_size)]
        mine = {}
        for r in range(self.world_size):
            kjt = power_law_batch(step, r, TABLES)
            for f in kjt.keys():
                name = self.table_of[f]
                ids, outs = kjt[f].values().tolist(), []
                at = 0
                for length in kjt[f].lengths().tolist():
                    bag = ids[at:at + length]
                    at += length
                    found = [self._read(r, name, k) for k in bag]
                    if self.pooled:
                        pooled = sum(found, torch.zeros(DIM, dtype=torch.float64))
                        outs.append(pooled)
                        per_id = [2 * (pooled - TARGET[f])] * len(bag)
                    else:
                        outs += found
                        per_id = [2 * (row - TARGET[f]) for row in found]
                    for k, g in zip(bag, per_id):
                        grads[name][k] = grads[name].get(k, 0) + g / self.world_size
                        if k in self.hot[name]:
                            own[r][name][k] = own[r][name].get(k, 0) + g
                if r == rank:
                    mine[f] = torch.stack(outs) if outs else torch.zeros(0, DIM, dtype=torch.float64)
        for name, by_key in grads.items():
            for key, g in by_key.items():
                if key in self.hot[name]:
                    self.pending[name][key] = self.pending[name].get(key, 0) + g
                else:
                    self.rows[name][key] -= self.lr * g
        for r, by_table in enumerate(own):  # each rank's copies take its own gradients
            for name, by_key in by_table.items():
                for key, g in by_key.items():
                    self.local[r][name][key] = self.local[r][name].get(key, 0) + g
        self.since += 1
        return mine


def owner_rows(dmp, world_size: int) -> Dict[str, Dict[int, torch.Tensor]]:
    """Every rank's embeddings of the dynamic tables, after checking that each rank
    holds only rows it owns."""
    rank, mine = dist.get_rank(), {}
    for name, module in get_dynamic_tables(dmp).items():
        rows = module.export_keys_values(name)
        assert bool((owner_rank(rows.keys, world_size) == rank).all()), f"{name}: a row not owned"
        mine[name] = dict(zip(rows.keys.tolist(), rows.embeddings))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {n: {k: v for part in gathered for k, v in part[n].items()} for n in mine}


def _check_rows(got: Dict[str, Dict[int, torch.Tensor]], reference: WindowReference, what: str) -> None:
    for name, rows in reference.rows.items():
        assert got[name].keys() == rows.keys(), (what, name, set(got[name]) ^ set(rows))
        for key, row in rows.items():
            torch.testing.assert_close(got[name][key].double(), row, **TOLERANCE,
                                       msg=f"{what}: {name} key {key}")


def stale_sgd_matches_window_reference(rank: int, world_size: int, staleness: int,
                                       collection: str, directory: str) -> None:
    """SGD with stale replicas = ``WindowReference``: outputs at every step, owner
    rows after ``DynamicEmbDump``'s flush (taken with steps pending), rows loaded
    into a model without replicas; no replica traffic on steps without a sync; the
    reference is far from training without delay for s > 1 (the test can fail),
    equal to it for s = 1."""
    fused, pooled = OPTIMIZERS["sgd"], collection == "ebc"
    dmp = build(world_size, fused, True, collection=collection, staleness=staleness, tables=TABLES)
    assert all(s.stale is not None and s.staleness == staleness for s in replica_sets(dmp))
    preload(dmp, world_size, rank)
    reference = WindowReference(world_size, fused["learning_rate"], pooled, staleness)
    undelayed = WindowReference(world_size, fused["learning_rate"], pooled, staleness)
    sharded = dmp.module.ebc if pooled else dmp.module.ec
    quiet_steps = 0
    for step in range(9):
        if step in (0, REFRESH_AT):
            hot = HOT if step == 0 else LATER_HOT
            refresh_replicas(dmp, {n: torch.tensor(ids) for n, ids in hot.items()})
            reference.set_hot(hot)
        sharded.id_counters.reset()
        got = train_step(dmp, step, rank, pooled)
        want = reference.step(step, rank)
        undelayed.step(step, rank)
        for f, v in want.items():
            torch.testing.assert_close(got[f].double(), v, **TOLERANCE, msg=f"step {step} feature {f}")
        counters = sharded.id_counters
        assert counters.replicated > 0, step
        if step == REFRESH_AT:  # the refresh pushed the window's gradients first
            assert counters.replica_grads > 0 and counters.replica_rows > 0, step
        if counters.replica_rows == 0:  # a step without a sync crosses nothing for replicas
            assert counters.replica_slots == 0 and counters.replica_grads == 0, step
            quiet_steps += 1
    assert quiet_steps >= 9 - 2 - 9 // staleness, quiet_steps
    assert any(s.stale.steps for s in replica_sets(dmp)), "the test should end mid-window"
    DynamicEmbDump(directory, dmp)  # flushes the pending steps first
    reference.flush()
    undelayed.flush()
    _check_rows(owner_rows(dmp, world_size), reference, "after the dump's flush")
    far = max(float((reference.rows["s_hot"][k] - undelayed.rows["s_hot"][k]).abs().max())
              for k in HOT["s_hot"])
    if staleness == 1:  # a window of one step applies every step's gradients: synchronous
        assert far < 1e-9, far
    else:
        assert far > 1e-3, f"the window's delay should show on hot rows, differs by {far}"
    plain = build(world_size, fused, False, collection=collection, tables=TABLES)
    DynamicEmbLoad(directory, plain)
    _check_rows(owner_rows(plain, world_size), reference, "loaded without replicas")
    again = build(world_size, fused, True, collection=collection, staleness=staleness, tables=TABLES)
    refresh_replicas(again, {n: torch.tensor(ids) for n, ids in HOT.items()})
    train_step(again, 0, rank, pooled)  # pulls copies, trains a step on them
    DynamicEmbLoad(directory, again)  # drops them: the next lookup reads the loaded rows
    with torch.no_grad():
        batch = power_law_batch(30, rank, TABLES)
        want, got = _outputs(plain(batch), pooled), _outputs(again(batch), pooled)
    for f in want:
        torch.testing.assert_close(got[f], want[f], atol=0.0, rtol=0.0, msg=f"after a load: {f}")


def stale_state_dict_and_flush(rank: int, world_size: int) -> None:
    """``state_dict`` and ``flush_replicas`` apply pending steps (once: a second call
    changes nothing); row-wise Adagrad trains with stale replicas (EBC)."""
    fused = OPTIMIZERS["rowwise_adagrad"]
    dmp = build(world_size, fused, True, collection="ebc", staleness=3, tables=TABLES)
    preload(dmp, world_size, rank)
    refresh_replicas(dmp, {n: torch.tensor(ids) for n, ids in HOT.items()})
    train_step(dmp, 0, rank, pooled=True)
    before = owner_rows(dmp, world_size)
    dmp.state_dict()
    after = owner_rows(dmp, world_size)
    moved = [k for k in HOT["s_hot"] if not torch.equal(before["s_hot"][k], after["s_hot"][k])]
    assert moved, "the state dict should have applied the hot rows' pending gradients"
    assert flush_replicas(dmp) == 0  # nothing pending any more
    for step in range(1, 3):
        train_step(dmp, step, rank, pooled=True)
    assert flush_replicas(dmp) == 1
    flushed = owner_rows(dmp, world_size)
    assert flush_replicas(dmp) == 0
    again = owner_rows(dmp, world_size)
    for name in flushed:
        assert all(torch.equal(again[name][k], v) for k, v in flushed[name].items()), name
        assert all(bool(torch.isfinite(v).all()) for v in flushed[name].values()), name


def stale_refusals(rank: int, world_size: int) -> None:
    """Adam, weight decay and mixed staleness in one sharding are refused when the
    model is sharded, with errors that name the cause."""
    cases = [
        (OPTIMIZERS["adam"], TABLES, "ADAM is refused"),
        ({**OPTIMIZERS["sgd"], "weight_decay": 0.01}, TABLES, "weight_decay"),
    ]
    for fused, tables, says in cases:
        try:
            build(world_size, fused, True, staleness=2, tables=tables)
        except ValueError as err:
            assert says in str(err), str(err)
        else:
            raise AssertionError(f"a model with stale replicas took {fused}")
    mixed = dict(TABLES)
    mixed["s_fresh"] = (16384, ["e"], "row_wise", 4)
    try:
        build(world_size, OPTIMIZERS["sgd"], True, staleness={"s_hot": 2, "s_frac": 2},
              tables=mixed)
    except ValueError as err:
        assert "share replica_staleness" in str(err), str(err)
    else:
        raise AssertionError("a sharding with two stalenesses was built")


# ids no batch draws (power_law_batch: 0..1999 and negatives), replicated from the start
UNSEEN = {"s_hot": [10**12 + 1, 10**12 + 2], "s_frac": [10**12 + 3, -(10**12)]}


def _unseen_batch() -> "KeyedJaggedTensor":
    """One sample per feature whose ids training never saw (and a trained one)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: PLC0415
    values = {"a": UNSEEN["s_hot"] + [0], "b": [UNSEEN["s_hot"][1]], "c": UNSEEN["s_frac"],
              "d": [10**12 + 5]}
    return KeyedJaggedTensor(keys=list(values), values=torch.tensor(sum(values.values(), [])),
                             lengths=torch.tensor([len(v) for v in values.values()]))


def stale_eval_of_unseen_ids(rank: int, world_size: int) -> None:
    """Eval reads a replicated id that no training step stored as eval without
    replicas does (the eval initializer's row), at staleness 0 and 2, when the ids
    are given to ``refresh_replicas`` directly; a trained id reads its copy."""
    fused = OPTIMIZERS["sgd"]
    read = {}
    for label, replicated, staleness in (("none", False, 0), ("s0", True, 0), ("s2", True, 2)):
        dmp = build(world_size, fused, replicated, collection="ec", staleness=staleness,
                    tables=TABLES)
        preload(dmp, world_size, rank)
        if replicated:
            refresh_replicas(dmp, {n: torch.tensor(HOT[n] + UNSEEN[n]) for n in HOT})
        for step in range(3):
            train_step(dmp, step, rank, pooled=False)
        dmp.eval()
        with torch.no_grad():
            read[label] = _outputs(dmp(_unseen_batch()), pooled=False)
        dmp.train()
    for label in ("s0", "s2"):
        for f, want in read["none"].items():
            got = read[label][f]
            unseen = slice(0, -1) if f == "a" else slice(None)  # a's last id was trained
            torch.testing.assert_close(got[unseen], want[unseen], atol=0.0, rtol=0.0,
                                       msg=f"{label}: feature {f}'s unseen ids")
            assert bool((want[unseen] == 0).all()), f"the eval initializer reads zeros ({f})"
        assert bool(read[label]["a"][-1].ne(0).any()), f"{label}: a trained id reads its row"
