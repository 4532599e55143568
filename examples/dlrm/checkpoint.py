"""Save and resume the DLRM job (``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``).

The recipe of docs/CHECKPOINTS.md: dynamic tables through ``DynamicEmbDump`` /
``DynamicEmbLoad`` (every rank, any world size), the dense and static parameters and
the fused optimizer state through ``torch.distributed.checkpoint``, the dense optimizer
through its ``state_dict``. Checkpoints alternate between two slots, ``DIR/a`` and
``DIR/b``; ``DIR/latest.json`` names the complete one and is replaced (atomically, by
rank 0) only after every rank finished writing, so a crash while saving leaves the
previous checkpoint whole.
"""

import json
import os
import shutil
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dynamicemb import DynamicEmbDump, DynamicEmbLoad

SLOTS = ("a", "b")
LATEST = "latest.json"
# The arguments that shape the model and its sharding: a resume must repeat them.
MODEL_ARGS = ("data", "data_dir", "scale", "collection", "embedding_dim", "embedding_dtype",
              "dense_arch", "over_arch", "optimizer", "dynamic_threshold", "cache_fraction",
              "batch_size", "seed")


def latest(directory: str) -> Optional[Dict]:
    """The progress record of the newest complete checkpoint, or None if there is none.

    Raises:
        ValueError: ``latest.json`` exists but cannot be read.
    """
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        if record["slot"] not in SLOTS:
            raise ValueError(f"unknown slot {record['slot']!r}")
        return record
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a checkpoint record: {err}") from err


def _dense_state(dmp) -> Dict:
    return {"model": dmp.state_dict(), "fused": dmp.fused_optimizer.state_dict()}


def save(directory: str, dmp, dense_optimizer, progress: Dict) -> None:
    """Every rank: writes the model into the slot not named by ``latest.json``, then
    rank 0 points ``latest.json`` at it.

    Args:
        progress: JSON-able record of where training is (step, epoch, batch in epoch,
            samples, history, the model's arguments); returned by ``load``.
    """
    previous = latest(directory)
    slot = SLOTS[1] if previous is not None and previous["slot"] == SLOTS[0] else SLOTS[0]
    where = os.path.join(directory, slot)
    if dist.get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
    dist.barrier()
    DynamicEmbDump(os.path.join(where, "dynamic"), dmp, allow_overwrite=True)
    dcp.save(_dense_state(dmp), checkpoint_id=os.path.join(where, "dense"))
    if dist.get_rank() == 0:
        torch.save(dense_optimizer.state_dict(), os.path.join(where, "dense_optimizer.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(directory, LATEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(dict(progress, slot=slot), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, LATEST))
    dist.barrier()


def load(directory: str, dmp, dense_optimizer, args) -> Dict:
    """Every rank: restores the newest checkpoint into a model sharded as for training.

    Returns:
        The progress record given to ``save``.

    Raises:
        ValueError: there is no checkpoint, or it was made with other model arguments.
    """
    record = latest(directory)
    if record is None:
        raise ValueError(f"--resume: {directory} holds no checkpoint ({LATEST} is missing)")
    recorded = {"embedding_dtype": "fp32", **record["model_args"]}  # older runs: float32
    differ = {k: (recorded.get(k), getattr(args, k)) for k in MODEL_ARGS
              if recorded.get(k) != getattr(args, k)}
    if differ:
        raise ValueError("--resume: the checkpoint was made with other arguments "
                         + ", ".join(f"--{k.replace('_', '-')} {a!r} (now {b!r})"
                                     for k, (a, b) in differ.items()))
    where = os.path.join(directory, record["slot"])
    DynamicEmbLoad(os.path.join(where, "dynamic"), dmp)
    state = _dense_state(dmp)
    dcp.load(state, checkpoint_id=os.path.join(where, "dense"))
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["fused"])
    dense_optimizer.load_state_dict(
        torch.load(os.path.join(where, "dense_optimizer.pt"), weights_only=True))
    return record


def model_args(args) -> Dict:
    """The arguments a resumed run must repeat, as recorded in a checkpoint."""
    return {k: getattr(args, k) for k in MODEL_ARGS}
