"""Rank bodies of the DMP state-dict tests (spawned; importable, no pytest here).

A collection mixing a static TorchRec table ("st", FBGEMM's kernel) with the dynamic
tables of ``checkpoint_workers`` ("rw" row-wise, "tw" table-wise)."""

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmEmbOptimType
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dynamicemb
from dynamicemb import DynamicEmbDump, DynamicEmbInitializerArgs, DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingCollectionSharder, get_dynamic_tables
from dynamicemb_testing.checkpoint_testing import bits
from dynamicemb_testing.shard_workers import EcModel

CPU = torch.device("cpu")
TABLES = {"st": ["s"], "rw": ["f", "g"], "tw": ["h"]}  # all dim 8
FEATURES = ["s", "f", "g", "h"]
ROWS = 256
# the failing case first: this package's enum, then upstream's (FBGEMM's)
ENUMS = {"dynamicemb": dynamicemb.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
         "fbgemm": FbgemmEmbOptimType.EXACT_ROWWISE_ADAGRAD}


GLOBAL_BATCH = 8
DYNAMIC = ("rw", "tw")


def build(world_size: int, optimizer=FbgemmEmbOptimType.EXACT_ROWWISE_ADAGRAD,
          pg=None, dtype=None) -> DistributedModelParallel:
    """The mixed collection on the ranks of ``pg`` (default: every rank), its dynamic
    tables' rows in ``dtype`` (None: float32)."""
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name=n, num_embeddings=ROWS, embedding_dim=8, feature_names=f)
        for n, f in TABLES.items()], device=torch.device("meta"))
    sharder = DynamicEmbeddingCollectionSharder(
        fused_params={"optimizer": optimizer, "learning_rate": 0.05, "eps": 1e-8})
    plan = construct_module_sharding_plan(
        ec, {"st": row_wise(compute_kernel="fused"), "rw": row_wise(compute_kernel="fused"),
             "tw": table_wise(rank=world_size - 1, compute_kernel="fused")},
        sharder=sharder, local_size=get_local_size(world_size), world_size=world_size,
        device_type="cpu")
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1)
    for name in DYNAMIC:
        plan[name] = to_dynamic_sharding(plan[name], DynamicEmbTableOptions(
            dim=8, max_capacity=ROWS, initializer_args=init, embedding_dtype=dtype))
    torch.manual_seed(0)  # the static table's initial rows
    env = ShardingEnv.from_process_group(pg if pg is not None else dist.group.WORLD)
    return DistributedModelParallel(EcModel(ec), plan=ShardingPlan({"ec": plan}), env=env,
                                    sharders=[sharder], device=CPU)


def local_batch(step: int, rank: int, world_size: int) -> KeyedJaggedTensor:
    """This rank's slice of the global batch of ``step`` (same global batch for any W)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(FEATURES), GLOBAL_BATCH), generator=g)
    values = [torch.randint(0, ROWS, (int(n),), generator=g) for n in lengths.flatten()]
    per = GLOBAL_BATCH // world_size
    mine = range(GLOBAL_BATCH)[rank * per:(rank + 1) * per]
    vals = [values[f * GLOBAL_BATCH + b] for f in range(len(FEATURES)) for b in mine]
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(vals),
                             lengths=lengths[:, mine.start:mine.stop].flatten())


def _gather(obj, pg):
    out = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, obj, group=pg)
    return out


def train(dmp, steps, pg=None) -> torch.Tensor:
    """Trains on the global batches of ``steps`` (loss scaled by the world size, which
    TorchRec divides gradients by); returns the global outputs, feature by feature
    (the same order for any world size)."""
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    outs = []
    for step in steps:
        out = dmp(local_batch(step, rank, world_size))
        loss = sum(((out[f].values() - 0.25) ** 2).sum() for f in FEATURES) * world_size
        loss.backward()
        gathered = _gather({f: out[f].values().detach() for f in FEATURES}, pg)
        outs += [torch.cat([g[f] for g in gathered]).flatten() for f in FEATURES]
    return torch.cat(outs)


def dynamic_rows(dmp, pg=None) -> dict:
    """Every rank's rows of the dynamic tables (keys, embeddings, states, scores), sorted."""
    local = {n: tuple(m.export_keys_values(n)) for n, m in get_dynamic_tables(dmp).items()}
    merged = {}
    for name in DYNAMIC:
        parts = [g[name] for g in _gather(local, pg) if name in g]
        rows = [torch.cat([p[i] for p in parts]) for i in range(4)]
        order = rows[0].argsort()
        merged[name] = [t[order] for t in rows]
    return merged


def assert_rows(got: dict, want: dict, exact: bool) -> None:
    for name in DYNAMIC:
        assert got[name][0].numel() > 0, name
        for i, (x, y) in enumerate(zip(got[name], want[name])):
            if exact or i in (0, 3):  # keys and scores always: no row dropped
                assert x.dtype == y.dtype and torch.equal(bits(x), bits(y)), (name, i)
            else:
                torch.testing.assert_close(x, y)


def dcp_state(dmp) -> dict:
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def dcp_load(dmp, path: str, pg=None) -> None:
    """The TorchRec way: DCP fills the state dicts, then the model loads them."""
    state = dcp_state(dmp)
    dcp.load(state, checkpoint_id=path, process_group=pg)
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])


def _expect_refusal(action, *words) -> None:
    try:
        action()
    except BaseException as err:  # DCP raises CheckpointException (a BaseException)
        assert all(w in str(err) for w in words), str(err)
        return
    raise AssertionError(f"expected a refusal naming {words}")


def _dynamic_only(state: dict) -> dict:
    """A state dict without the static table (TorchRec's ShardedTensor, which
    ``torch.load(weights_only=True)`` refuses; upstream's example has none)."""
    return {k: v for k, v in state.items() if ".st." not in k}


def _check_pickled(pickled: str, world_size: int, want_rows) -> None:
    """A pickled state dict (saved before the dump) read with weights_only=True
    restores the dynamic tables exactly (5 more steps give the uninterrupted run's
    rows: the dynamic features' losses do not depend on the static table, which the
    file does not hold); on another rank's file or another optimizer it is refused
    and nothing changes."""
    rank = dist.get_rank()
    state = torch.load(pickled, weights_only=True)
    entry = state["ec.embeddings.rw.dynamic_state"]
    assert type(entry) is torch.Tensor and entry.dtype == torch.int64 and entry.shape[0] > 2
    restored = build(world_size)
    train(restored, range(20, 22))  # other contents first: the load replaces them
    restored.load_state_dict({**restored.state_dict(), **state})
    train(restored, range(4, 9))
    assert_rows(dynamic_rows(restored), want_rows, exact=True)

    dist.barrier()  # every rank's file is written
    swapped = torch.load(os.path.join(os.path.dirname(pickled), f"model{1 - rank}.pt"),
                         weights_only=True)
    untouched = build(world_size)
    train(untouched, range(20, 22))
    before = dynamic_rows(untouched)
    _expect_refusal(lambda: untouched.load_state_dict({**untouched.state_dict(), **swapped}),
                    "embeddings.rw.dynamic_state",
                    f"saved by rank {1 - rank} of a table in 2 shard(s)", "dcp.save")
    sgd = build(world_size, FbgemmEmbOptimType.EXACT_SGD)
    _expect_refusal(lambda: sgd.load_state_dict({**sgd.state_dict(), **state}),
                    "dynamic table 'rw'", "dim 8 + 0 optimizer-state columns")
    assert_rows(dynamic_rows(untouched), before, exact=True)


def _check_snapshot(snapshot: dict, pickled: str) -> None:
    """``copy.deepcopy`` of a state dict (taken before the pickled one was written and
    before more training) holds each dynamic table's records as plain int64 tensors,
    equal to the pickled file's: a snapshot, not a view of the live tables."""
    saved = torch.load(pickled, weights_only=True)
    entries = [k for k in snapshot if k.endswith(".dynamic_state")]
    assert entries and entries == [k for k in saved if k.endswith(".dynamic_state")], entries
    for key in entries:
        assert type(snapshot[key]) is torch.Tensor, (key, type(snapshot[key]))
        assert torch.equal(snapshot[key], saved[key]), key


def _check_enums(world_size: int) -> None:
    """Both enums: the mixed collection trains identically (static rows included)."""
    runs = []
    for optimizer in ENUMS.values():
        dmp = build(world_size, optimizer)
        outs = train(dmp, range(3))
        st = dmp.state_dict()["ec.embeddings.st.weight"].local_shards()
        runs.append((outs, st[0].tensor.clone() if st else None, dynamic_rows(dmp)))
    (out_a, st_a, rows_a), (out_b, st_b, rows_b) = runs
    assert torch.equal(out_a, out_b)
    assert st_a is None or torch.equal(st_a, st_b)
    assert_rows(rows_a, rows_b, exact=True)


def _clocks(dmp) -> dict:
    return {n: m.table_clocks(n) for n, m in get_dynamic_tables(dmp).items()}


def _check_sixteen_bit(world_size: int, directory: str) -> None:
    """bfloat16 dynamic tables through DCP: rows, states, scores and clocks (the
    optimizer step names the rounding bits) come back bit for bit and training goes on
    identically; float32 and float16 tables refuse the records, naming both dtypes, and
    keep their rows."""
    path = os.path.join(directory, "ck-bf16")
    ref = build(world_size, dtype=torch.bfloat16)
    train(ref, range(3))
    dcp.save(dcp_state(ref), checkpoint_id=path)
    loaded = build(world_size, dtype=torch.bfloat16)
    train(loaded, range(20, 22))  # other contents first: the load replaces them
    dcp_load(loaded, path)
    want = dynamic_rows(ref)
    assert want["rw"][1].dtype == torch.bfloat16
    assert_rows(dynamic_rows(loaded), want, exact=True)
    assert _clocks(loaded) == _clocks(ref) and all(
        c.optimizer_step == 3 for c in _clocks(ref).values()), _clocks(loaded)
    assert torch.equal(train(loaded, range(3, 5)), train(ref, range(3, 5)))
    assert_rows(dynamic_rows(loaded), dynamic_rows(ref), exact=True)
    for dtype, name in ((None, "float32"), (torch.float16, "float16")):  # other width; same width
        other = build(world_size, dtype=dtype)
        train(other, range(30, 32))
        before = dynamic_rows(other)
        _expect_refusal(lambda: dcp.load({"model": other.state_dict()}, checkpoint_id=path),
                        "dynamic table", "bfloat16 embeddings, this table has",
                        f"{name} embeddings")
        assert_rows(dynamic_rows(other), before, exact=True)  # nothing lost


def dcp_round_trips(rank: int, world_size: int, directory: str) -> None:
    """One spawn of 2 ranks: both optimizer enums on the mixed collection; DCP save
    on 2 ranks, loaded on 2 (exact) and on 1 (a 1-rank group); saved on 1, loaded
    on 2. Each load is followed by 5 steps equal to the uninterrupted run, and
    the dynamic rows then equal its rows (keys and scores exactly). Then bfloat16
    tables, saved and loaded on 2 ranks."""
    _check_enums(world_size)
    ck2, ck1 = os.path.join(directory, "ck2"), os.path.join(directory, "ck1")
    ref = build(world_size)
    train(ref, range(4))
    dcp.save(dcp_state(ref), checkpoint_id=ck2)
    pickled = os.path.join(directory, f"model{rank}.pt")
    snapshot = copy.deepcopy(_dynamic_only(ref.state_dict()))  # a "best state" copy
    # upstream's example's order: torch.save of the state dict, then DynamicEmbDump
    torch.save(_dynamic_only(ref.state_dict()), pickled)
    DynamicEmbDump(os.path.join(directory, "dump"), ref)
    want_outs = train(ref, range(4, 9))
    want_rows = dynamic_rows(ref)
    _check_snapshot(snapshot, pickled)
    _check_pickled(pickled, world_size, want_rows)

    loaded = build(world_size)
    train(loaded, range(20, 22))  # other contents first: the load replaces them
    dcp_load(loaded, ck2)
    assert torch.equal(train(loaded, range(4, 9)), want_outs)
    assert_rows(dynamic_rows(loaded), want_rows, exact=True)
    other = {"model": build(world_size, FbgemmEmbOptimType.EXACT_SGD).state_dict()}  # no states
    _expect_refusal(lambda: dcp.load(other, checkpoint_id=ck2), "dynamic table 'rw'",
                    "dim 8 + 0 optimizer-state columns")

    one = dist.new_group([0])
    if rank == 0:  # 2 -> 1, then a 1-rank checkpoint
        single = build(1, pg=one)
        dcp_load(single, ck2, pg=one)
        torch.testing.assert_close(train(single, range(4, 9), one), want_outs)
        assert_rows(dynamic_rows(single, one), want_rows, exact=False)
        saver = build(1, pg=one)
        train(saver, range(4), one)
        dcp.save(dcp_state(saver), checkpoint_id=ck1, process_group=one)
        box = [(train(saver, range(4, 9), one), dynamic_rows(saver, one))]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=0)  # the uninterrupted 1-rank run
    widened = build(world_size)  # 1 -> 2
    dcp_load(widened, ck1)
    torch.testing.assert_close(train(widened, range(4, 9)), box[0][0])
    assert_rows(dynamic_rows(widened), box[0][1], exact=False)
    _check_sixteen_bit(world_size, directory)
