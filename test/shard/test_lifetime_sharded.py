"""TTL under DistributedModelParallel on 2 gloo ranks: row-wise and table-wise tables
expire their rows against a dict model, each rank sweeping its own (one spawn)."""

from dynamicemb_testing.dist_utils import run_distributed
from dynamicemb_testing.lifetime_workers import ttl_under_dmp


def test_ttl_under_dmp_on_two_ranks():
    run_distributed(ttl_under_dmp, 2)
