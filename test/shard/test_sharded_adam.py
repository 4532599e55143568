"""Adam, and the other fused params, on sharded dynamic tables (2 gloo ranks) against
unsharded dynamic tables built with the same params and fed the global batch
(TorchRec's CPU kernels have no Adam to compare with)."""

from dynamicemb_testing.dist_utils import run_distributed
from dynamicemb_testing import adam_workers


def test_sharded_adam_matches_unsharded_tables():
    run_distributed(adam_workers.sharded_adam_vs_unsharded, 2)


def test_sharded_fused_params_match_unsharded_tables():
    """initial_accumulator_value, weight_decay_mode (both forms), gradient_clipping /
    max_gradient, eps, betas, output_dtype reach the EC and EBC kernels; max_norm is
    refused by name."""
    run_distributed(adam_workers.sharded_fused_params, 2)
