"""Row-wise EmbeddingBagCollection id dedup (2 gloo ranks) against native TorchRec."""

from dynamicemb_testing.dist_utils import run_distributed
from dynamicemb_testing import dedup_workers


def test_ebc_rowwise_dedup_matches_native_tables():
    run_distributed(dedup_workers.dedup_twins, 2)
