"""Rank bodies of the serving tests (spawned; importable, no pytest here)."""

import torch
import torch.distributed as dist

from dynamicemb import DynamicEmbDump
from dynamicemb_testing import shard_workers as sw

#: Steps whose batches the eval outputs are recorded for (each rank its own batch).
EVAL_STEPS = (100, 101)


def _gather(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _fields(kjt):
    """A KJT as plain fields (the record loads with ``weights_only=True``)."""
    return {"keys": kjt.keys(), "values": kjt.values(), "lengths": kjt.lengths()}


def train_dump_and_eval(rank: int, world_size: int, path: str, record: str) -> None:
    """Trains the shard tests' EC + EBC model (dynamic row-wise and table-wise tables,
    a static one in each; SUM and MEAN bags) under DMP, dumps its dynamic tables, and
    records every rank's eval batches and outputs and the static tables' weights
    (rank 0 writes them)."""
    dmp = sw._build(world_size, "adagrad", dynamic=True)
    for step in range(4):
        ec_out, ebc_out = dmp(*sw._batch(step, rank))
        sw._loss(ec_out, ebc_out).backward()
    DynamicEmbDump(path, dmp)
    static = {name: sw._full_dense(dmp, name, (rows, dim))
              for tables in (sw.EC_TABLES, sw.EBC_TABLES)
              for name, (rows, dim, _, sharding) in tables.items() if sharding is None}
    dmp.eval()
    evals = []
    with torch.no_grad():
        for step in EVAL_STEPS:
            ec, ebc = sw._batch(step, rank)
            ec_out, ebc_out = dmp(ec, ebc)
            evals.append({"ec": _fields(ec), "ebc": _fields(ebc), "ebc_out": ebc_out.to_dict(),
                          "ec_out": {f: ec_out[f].values() for f in ec_out.keys()}})
    gathered = _gather(evals)
    if rank == 0:
        torch.save({"static": static, "evals": [e for per in gathered for e in per]}, record)
