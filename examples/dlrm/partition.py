"""Graph-partitioned placement for the DLRM job (HET-GMP's ``partition.py``).

Reads a sample of the training data through the job's readers, partitions the
sample-id bipartite graph over the ranks with METIS (``dynamicemb.partition``) and
writes a placement file (``dynamicemb.placement``: an ``.npz`` without pickled
objects) naming each kept id's rank, per dynamic table (``t_cat_<i>``). Train with
it: ``train.py --placement FILE`` puts those ids on their rank and routes each
sample to the rank that owns most of its ids (``RoutedBatches``).

Examples::

    # 2 ranks, 200k synthetic samples (the job's defaults: --scale 0.05, --alpha 1.05)
    python examples/dlrm/partition.py --world-size 2 --samples 200000 -o placement_2.npz
    # MovieLens-100K's training ratings (all of them), user and item tables placed
    python examples/dlrm/partition.py --data movielens --dynamic-threshold 900 \
        --world-size 2 -o placement_ml.npz
    # 2 nodes of 4 ranks (topology-weighted: inter-node cuts first), Criteo day files
    python examples/dlrm/partition.py --data tsv --train-files day_0 --world-size 8 \\
        --ranks-per-node 4 --samples 1000000 -o placement_8.npz
"""

import argparse
import json
import resource
import sys
import time
from typing import Dict, Iterable, Iterator, List, Mapping

import numpy as np
import torch

from data import EMPTY_ID, Batch, CriteoParquetReader, CriteoTsvReader, SyntheticCriteo
from dynamicemb.partition import PartitionConfig, partition_ids, route_samples
from dynamicemb.placement import TablePlacement, owner_rank, write_placement
from model import feature_names, table_specs
from movielens import MovieLens

__all__ = ["RoutedBatches", "main", "read_sample"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("Examples::")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", required=True, help="the placement file to write (.npz)")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the training job")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node (default: all on one node)")
    p.add_argument("--samples", type=int, default=200_000,
                   help="training samples to read (all of them if fewer)")
    p.add_argument("--data", choices=["synthetic", "tsv", "parquet", "movielens"], default="synthetic")
    p.add_argument("--data-dir", help="movielens: as train.py's (default: the recbole wheel's files)")
    p.add_argument("--train-files", help="comma-separated files (tsv/parquet)")
    p.add_argument("--scale", type=float, default=0.05, help="synthetic: as train.py's")
    p.add_argument("--alpha", type=float, default=1.05, help="synthetic: as train.py's")
    p.add_argument("--seed", type=int, default=0,
                   help="as train.py's: synthetic data, MovieLens' training split")
    p.add_argument("--dynamic-threshold", type=int, default=1000, help="as train.py's: tables "
                   "of at least this many rows are dynamic and get a placement")
    p.add_argument("--min-count", type=int, default=2,
                   help="ids seen fewer times in the sample keep their hash owner")
    p.add_argument("--max-ids", type=int, help="place at most this many ids, the most frequent")
    p.add_argument("--imbalance", type=int, default=30, help="METIS ufactor (30: 3%% imbalance)")
    p.add_argument("--replicas", type=float, default=0,
                   help="as train.py's --replicas: the ids hot-row replicas will serve (a "
                   "fraction of each table's ids, or a count), the most frequent in the "
                   "sample, stay out of the partition (local to every rank); the file lists "
                   "them (train.py --replicas placement replicates exactly those)")
    args = p.parse_args(argv)
    if args.data in ("tsv", "parquet") and not args.train_files:
        p.error(f"--data {args.data} needs --train-files")
    if args.samples < 1:
        p.error("--samples must be >= 1")
    return args


def read_sample(args) -> np.ndarray:
    """The first ``--samples`` training samples' ids, (S, F) int64, over all ranks."""
    if args.data == "synthetic":
        source: Iterable[Batch] = SyntheticCriteo(args.samples, 65536, scale=args.scale,
                                                  alpha=args.alpha, seed=args.seed)
    elif args.data == "movielens":
        source = MovieLens(65536, folder=args.data_dir, seed=args.seed)
    else:
        reader = CriteoTsvReader if args.data == "tsv" else CriteoParquetReader
        source = reader(args.train_files.split(","), 65536)
    parts, count = [], 0
    for batch in source:
        parts.append(batch.sparse.numpy()[:args.samples - count])
        count += len(parts[-1])
        if count >= args.samples:
            break
    if not parts:
        raise SystemExit(f"no training samples read from --data {args.data}")
    return np.concatenate(parts)


def dynamic_columns(args) -> List[int]:
    """The features whose tables are dynamic (train.py's ``table_specs``)."""
    return [f for f, t in enumerate(table_specs(args)) if t.dynamic]


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    sparse = read_sample(args)
    read = time.perf_counter() - start
    columns = dynamic_columns(args)
    names = [f"t_{f}" for f in feature_names(sparse.shape[1])]
    try:
        config = PartitionConfig(world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                                 min_count=args.min_count, max_ids=args.max_ids,
                                 imbalance=args.imbalance, replicas=args.replicas)
    except ValueError as err:
        raise SystemExit(f"partition.py: {err}") from None
    result = partition_ids(sparse[:, columns], [names[f] for f in columns], config, empty_id=EMPTY_ID)
    write_placement(args.output, args.world_size, result.placements,
                    result.replicated if args.replicas else None)
    stats = {**result.stats, "read_seconds": read,
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "output": args.output}
    print(json.dumps(stats, indent=1))


class RoutedBatches:
    """The job's batches routed by a placement: every rank reads the same global
    batches (``world_size`` x its batch size, from a reader of rank 0 of 1) and keeps
    the samples ``route_samples`` gives it, each sample going to the rank that owns
    most of its dynamic ids. Replicated ids (``set_replicated``) are local to every
    rank and vote for none.

    Args:
        source: global batches (e.g. ``SyntheticCriteo(..., batch_size=W * B)``).
        placements: ``{feature column: TablePlacement}`` of the dynamic tables.
        rank, world_size: this rank and the ranks.
    """

    def __init__(self, source: Iterable[Batch], placements: Mapping[int, TablePlacement],
                 rank: int, world_size: int) -> None:
        self.source, self.placements = source, dict(placements)
        self.rank, self.world_size = rank, world_size
        self.replicated: Dict[int, torch.Tensor] = {}

    def set_replicated(self, ids: Mapping[int, torch.Tensor]) -> None:
        """The replicated ids by feature column (``replicated_ids`` after each
        ``refresh_replicas``), for the batches read from now on. Call it with the same
        ids on every rank at the same batch, as the split must be the same."""
        self.replicated = {f: torch.unique(t.to(torch.int64).cpu()) for f, t in ids.items()}

    def __len__(self) -> int:
        """Batches per pass: the source's (a streaming reader has none: TypeError)."""
        return len(self.source)

    def __getattr__(self, name: str):  # bayes_auc, rows_read, ... of the source
        return getattr(self.__dict__["source"], name)

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.source:
            usable = batch.labels.numel() - batch.labels.numel() % self.world_size
            if usable == 0:
                return
            sparse = batch.sparse[:usable]
            owners = torch.stack([self._owners(sparse[:, f], f, p) for f, p in self.placements.items()], 1)
            mine = route_samples(owners, self.world_size)[self.rank]
            yield Batch(batch.dense[mine], batch.sparse[mine], batch.labels[mine])

    def _owners(self, ids: torch.Tensor, column: int, placement: TablePlacement) -> torch.Tensor:
        """The owner rank of each id of a column, -1 for a replicated id."""
        owners = owner_rank(ids, self.world_size, "hash", placement)
        hot = self.replicated.get(column)
        if hot is not None and hot.numel():
            owners[torch.isin(ids, hot)] = -1
        return owners


if __name__ == "__main__":
    sys.exit(main())
