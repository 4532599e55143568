"""A tiny 2-rank torchrun job in the shapes whose exit used to abort
("terminate called without an active exception"; see ``dynamicemb/clean_exit.py``).

It trains a row-wise dynamic EC table (device cache on, dedup on) for a few steps and
writes a checkpoint, then leaves in one of two shapes:

- ``destroy``: ``destroy_process_group()`` then a normal return (the test workers' shape);
- ``keep``: no ``destroy_process_group()``, the model a global alive into interpreter
  finalization (upstream dynamicemb's example scripts' shape).

Run: ``torchrun --standalone --nproc_per_node 2 exit_shapes.py --shape keep --out DIR``.
"""

import argparse

import torch
import torch.distributed as dist

from dynamicemb import DynamicEmbDump
from dynamicemb_testing.checkpoint_workers import FEATURES, build, local_batch

STEPS = 3


def train_and_save(out: str) -> torch.nn.Module:
    """Trains the model a few steps on this rank's batches and dumps it to ``out``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp = build(world, caching=True)
    for step in range(STEPS):
        result = dmp(local_batch(step, rank, world))
        loss = sum(((result[f].values() - 0.25) ** 2).sum() for f in FEATURES)
        loss.backward()
    DynamicEmbDump(out, dmp, allow_overwrite=True)
    return dmp


def main() -> torch.nn.Module:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["destroy", "keep"], required=True)
    parser.add_argument("--out", required=True, help="checkpoint directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dmp = train_and_save(args.out)
    if args.shape == "destroy":
        dist.destroy_process_group()
        return None
    return dmp


if __name__ == "__main__":
    MODEL = main()  # "keep": a global, as in a script written at module level
