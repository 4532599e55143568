"""The spawning helper reports a failing rank: assertions in rank bodies count."""

import pytest
from torch.multiprocessing import ProcessRaisedException

from dynamicemb_testing.dist_utils import fail_on_rank, run_distributed


def test_a_failing_rank_fails_the_run():
    with pytest.raises(ProcessRaisedException, match="rank 1 fails on purpose"):
        run_distributed(fail_on_rank, 2, 1)
