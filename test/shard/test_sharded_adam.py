"""Adam on sharded dynamic tables (2 gloo ranks) against unsharded dynamic tables
fed the global batch (TorchRec's CPU kernels have no Adam to compare with)."""

from dynamicemb_testing.dist_utils import run_distributed
from dynamicemb_testing import adam_workers


def test_sharded_adam_matches_unsharded_tables():
    run_distributed(adam_workers.sharded_adam_vs_unsharded, 2)
