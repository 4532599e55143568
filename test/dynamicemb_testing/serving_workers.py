"""Rank bodies of the serving tests (spawned; importable, no pytest here)."""

import torch
import torch.distributed as dist

from dynamicemb import DynamicEmbDump
from dynamicemb_testing import checkpoint_workers as ckpt

#: Steps whose global batches the eval outputs are recorded for.
EVAL_STEPS = (100, 101)


def train_dump_and_eval(rank: int, world_size: int, path: str, record: str) -> None:
    """Trains the checkpoint tests' EC model under DMP, dumps it, and records the
    global eval outputs of ``EVAL_STEPS`` (rank 0 writes them)."""
    dmp = ckpt.build(world_size, optimizer="adam")
    ckpt.train(dmp, range(6), rank, world_size)
    DynamicEmbDump(path, dmp)
    dmp.eval()
    outs = []
    with torch.no_grad():
        for step in EVAL_STEPS:
            out = dmp(ckpt.local_batch(step, rank, world_size))
            gathered = [None] * world_size
            dist.all_gather_object(gathered, {f: out[f].values() for f in ckpt.FEATURES})
            outs.append({f: torch.cat([g[f] for g in gathered]) for f in ckpt.FEATURES})
    if rank == 0:
        torch.save(outs, record)
