"""METIS (``pymetis``, what ``dynamicemb.partition`` uses) against Mt-KaHyPar on the
same sample-id graph of the DLRM job's synthetic data (8 dynamic features, ids seen
twice or more): seconds, the fraction of lookups local to their sample's rank, and
the parts' weights. Mt-KaHyPar is not a dependency: install it aside, e.g.
``pip install --target /tmp/mtk mtkahypar==1.7.post1``, then

    PYTHONPATH=.:/tmp/mtk python benchmark/compare_partitioners.py 204800 2
"""

import resource
import sys
import time

import numpy as np

sys.path.insert(0, "examples/dlrm")
from data import CRITEO_CARDINALITIES, SyntheticCriteo  # noqa: E402

from dynamicemb.partition import PartitionConfig, _cost, _metis, bipartite_graph  # noqa: E402


def _report(name: str, part: np.ndarray, seconds: float, xadj, adjncy, samples: int,
            config: PartitionConfig) -> None:
    source = np.repeat(np.arange(samples), np.diff(xadj[:samples + 1]))
    local, _ = _cost(part[source], part[adjncy[:xadj[samples]]], config)
    weights = np.bincount(part, minlength=config.world_size).tolist()
    print(f"{name}: {seconds:.1f} s, local {local:.4f}, part weights {weights}", flush=True)


def main(samples: int, world_size: int) -> None:
    import mtkahypar

    dynamic = [f for f, c in enumerate(CRITEO_CARDINALITIES) if round(c * 0.05) >= 1000]
    sparse = np.concatenate([b.sparse.numpy() for b in SyntheticCriteo(samples, 65536, scale=0.05)])
    config = PartitionConfig(world_size=world_size)
    xadj, adjncy = bipartite_graph(sparse[:, dynamic], np.arange(len(dynamic)), config)[:2]
    start = time.perf_counter()
    part = _metis(xadj, adjncy, world_size, config)
    _report("metis", part, time.perf_counter() - start, xadj, adjncy, samples, config)

    vertices = len(xadj) - 1
    source = np.repeat(np.arange(vertices), np.diff(xadj))
    once = source < adjncy
    kahypar = mtkahypar.initialize(1)
    context = kahypar.context_from_preset(mtkahypar.PresetType.DEFAULT)
    context.set_partitioning_parameters(world_size, 0.03, mtkahypar.Objective.CUT)
    mtkahypar.set_seed(0)
    start = time.perf_counter()
    graph = kahypar.create_graph(context, vertices, int(once.sum()),
                                 list(zip(source[once].tolist(), adjncy[once].tolist())))
    partitioned = graph.partition(context)
    part = np.array([partitioned.block_id(v) for v in range(vertices)], np.int64)
    _report("mt-kahypar (graph, 1 thread)", part, time.perf_counter() - start, xadj, adjncy,
            samples, config)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
