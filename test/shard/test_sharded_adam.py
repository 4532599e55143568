"""Adam, and the other fused params, on sharded dynamic tables (2 gloo ranks) against
unsharded dynamic tables built with the same params and fed the global batch
(TorchRec's CPU kernels have no Adam to compare with). Both bodies share one spawn
(``SharedSpawns``)."""

import pytest

from dynamicemb_testing.dist_utils import SharedSpawns
from dynamicemb_testing import adam_workers


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    spawns = SharedSpawns(str(tmp_path_factory.mktemp("adam")))
    spawns.run(2, [("adam", adam_workers.sharded_adam_vs_unsharded, ()),
                   ("fused-params", adam_workers.sharded_fused_params, ())])
    return spawns


def test_sharded_adam_matches_unsharded_tables(two_ranks):
    two_ranks.check("adam")


def test_sharded_fused_params_match_unsharded_tables(two_ranks):
    """initial_accumulator_value, weight_decay_mode (both forms), gradient_clipping /
    max_gradient, eps, betas, output_dtype reach the EC and EBC kernels; max_norm is
    refused by name."""
    two_ranks.check("fused-params")
