"""Rank bodies of the ``dist_type`` placement tests (spawned; importable, no pytest
here). The model and batches are ``adam_workers``': row-wise and table-wise dynamic
tables of an EC and an EBC, ids small, huge and negative."""

import io
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint.format import Manifest
from dynamicemb.checkpoint.layout import MANIFEST, current_version
from dynamicemb.shard import get_dynamic_tables
from dynamicemb_testing import adam_workers
from dynamicemb_testing.placement_reference import owner

FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
ROW_WISE = [n for n, spec in {**adam_workers.EC_TABLES, **adam_workers.EBC_TABLES}.items()
            if spec[3] == "row_wise"]


def sharded_trains_like_unsharded(rank: int, world_size: int, dist_type: str, dedup: bool) -> None:
    """Row-wise tables placed by ``dist_type``: every row on the rank the reference
    function names, outputs and rows equal to unsharded tables fed the global batch."""
    adam_workers.sharded_vs_unsharded(rank, world_size, FUSED, dedup, dist_type)


def _train(dmp, steps: range, rank: int) -> None:
    for step in steps:
        ec = adam_workers._rank_batch(adam_workers.EC_TABLES, step, rank)
        ebc = adam_workers._rank_batch(adam_workers.EBC_TABLES, step, rank)
        ec_out, ebc_out = dmp(ec, ebc)
        loss = sum((ec_out[f].values() ** 2).sum() for f in ec_out.keys()) + (ebc_out.values() ** 2).sum()
        loss.backward()


def _rows(dmp, dist_type: str, world_size: int,
          placed: Optional[Dict[str, Dict[int, int]]] = None) -> Dict[str, Dict[int, torch.Tensor]]:
    """Every rank's rows of the row-wise tables, after checking that each row of this
    rank is one the reference places here (``placed[table][key]`` for the keys a
    placement file lists)."""
    rank = dist.get_rank()
    mine = {}
    for name, module in get_dynamic_tables(dmp).items():
        if name not in ROW_WISE:
            continue
        rows = module.export_keys_values(name)
        keys = rows.keys.tolist()
        listed = (placed or {}).get(name, {})
        misplaced = [k for k in keys if listed.get(k, owner(k, world_size, dist_type)) != rank]
        assert not misplaced, f"{name}: keys {misplaced[:5]} on rank {rank} ({dist_type})"
        mine[name] = dict(zip(keys, torch.cat([rows.embeddings, rows.optimizer_states], 1)))
    gathered: List = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {name: {k: v for part in gathered for k, v in part[name].items()} for name in ROW_WISE}


def checkpoints_across_placements(rank: int, world_size: int, directory: str) -> None:
    """A dump records its tables' ``dist_type``; ``DynamicEmbLoad`` into tables of
    another ``dist_type`` puts every row where the loading tables place it (nothing
    lost); a pickled DMP state dict, which holds one rank's rows, is refused by the
    other ``dist_type`` with both names and loads into its own."""
    saved = adam_workers._sharded(world_size, FUSED, True, "roundrobin")
    _train(saved, range(3), rank)
    want = _rows(saved, "roundrobin", world_size)
    assert all(len(want[name]) > 10 for name in ROW_WISE)
    DynamicEmbDump(directory, saved)
    manifest = Manifest.read(os.path.join(current_version(directory), MANIFEST))
    assert {manifest.tables[name].dist_type for name in ROW_WISE} == {"roundrobin"}

    hashed = adam_workers._sharded(world_size, FUSED, True, "hash")
    DynamicEmbLoad(directory, hashed)
    got = _rows(hashed, "hash", world_size)
    for name in ROW_WISE:
        assert set(got[name]) == set(want[name]), name
        for key, row in want[name].items():
            assert torch.equal(got[name][key], row), (name, key)

    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    state = lambda: torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)  # noqa: E731
    dynamic = lambda s: {k: v for k, v in s.items() if k.endswith(".dynamic_state")}  # noqa: E731
    try:
        hashed.load_state_dict({**hashed.state_dict(), **dynamic(state())})
    except ValueError as err:
        assert "dist_type='roundrobin'" in str(err) and "'hash'" in str(err), str(err)
    else:
        raise AssertionError("a roundrobin state dict loaded into hash-placed tables")
    after = _rows(hashed, "hash", world_size)  # the refusal changed nothing
    assert all(after[n].keys() == got[n].keys() and all(torch.equal(after[n][k], v)
               for k, v in got[n].items()) for n in ROW_WISE)
    restored = adam_workers._sharded(world_size, FUSED, True, "roundrobin")
    restored.load_state_dict({**restored.state_dict(), **dynamic(state())})
    got = _rows(restored, "roundrobin", world_size)
    for name in ROW_WISE:
        assert got[name].keys() == want[name].keys(), name
        assert all(torch.equal(got[name][k], v) for k, v in want[name].items()), name


def placement_trains_like_unsharded(rank: int, world_size: int, path: str,
                                    placed: Dict[str, Dict[int, int]], dedup: bool) -> None:
    """Row-wise tables with a placement file: the ids it lists on their rank, the
    others on their hash owner; outputs and rows equal to unsharded tables'."""
    adam_workers.sharded_vs_unsharded(rank, world_size, FUSED, dedup, "hash", path, placed)


def _equal_rows(got: Dict, want: Dict, what: str) -> None:
    for name in ROW_WISE:
        assert got[name].keys() == want[name].keys(), (what, name)
        assert all(torch.equal(got[name][k], v) for k, v in want[name].items()), (what, name)


def checkpoints_with_a_placement(rank: int, world_size: int, directory: str, path: str,
                                 placed: Dict[str, Dict[int, int]], rows_file: str) -> None:
    """A dump of placed tables records the file in its manifest; it loads into tables
    without the placement (rows on their hash owners) and back into placed ones (rows
    on their placed rank), nothing lost or doubled; a pickled state dict, which holds
    one rank's rows, is refused by the hash-placed tables. Rank 0 saves the rows for
    the test's world-size-1 load (``rows_file``)."""
    saved = adam_workers._sharded(world_size, FUSED, True, "hash", path)
    _train(saved, range(3), rank)
    want = _rows(saved, "hash", world_size, placed)
    moved = [k for name in ROW_WISE for k in want[name] if k in placed[name]
             and placed[name][k] != owner(k, world_size, "hash")]
    assert len(moved) > 5, moved  # the placement did move rows off their hash owner
    DynamicEmbDump(directory, saved)
    manifest = Manifest.read(os.path.join(current_version(directory), MANIFEST))
    for name in ROW_WISE:
        record = manifest.tables[name].placement
        assert record["file"] == os.path.basename(path) and record["world_size"] == world_size, record
        assert record["ids"] == len(placed[name]), record
    assert all(manifest.tables[n].placement is None for n in manifest.tables if n not in ROW_WISE)

    hashed = adam_workers._sharded(world_size, FUSED, True, "hash")
    DynamicEmbLoad(directory, hashed)
    _equal_rows(_rows(hashed, "hash", world_size), want, "load without the placement")
    again = adam_workers._sharded(world_size, FUSED, True, "hash", path)
    DynamicEmbLoad(directory, again)
    _equal_rows(_rows(again, "hash", world_size, placed), want, "load with the placement")

    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    try:
        hashed.load_state_dict({**hashed.state_dict(),
                                **{k: v for k, v in state.items() if k.endswith(".dynamic_state")}})
    except ValueError as err:
        assert "belong to another rank" in str(err), str(err)
    else:
        raise AssertionError("a placed state dict loaded into hash-placed tables")
    if rank == 0:
        torch.save(want, rows_file)
