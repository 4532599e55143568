"""Adam on sharded dynamic tables (2 gloo ranks) against unsharded dynamic tables
fed the global batch (TorchRec's CPU kernels have no Adam to compare with)."""

from dist_utils import run_distributed
import adam_workers


def test_sharded_adam_matches_unsharded_tables():
    run_distributed(adam_workers.sharded_adam_vs_unsharded, 2)
