"""The spawning helpers report a failing rank: assertions in rank bodies count."""

import pytest
from torch.multiprocessing import ProcessRaisedException

from dynamicemb_testing.dist_utils import SharedSpawns, fail_on_rank, run_distributed


def test_a_failing_rank_fails_the_run():
    with pytest.raises(ProcessRaisedException, match="rank 1 fails on purpose"):
        run_distributed(fail_on_rank, 2, 1)


def test_a_shared_spawn_fails_the_failing_case_and_every_case_after_it(tmp_path):
    spawns = SharedSpawns(str(tmp_path))
    spawns.run(2, [("before", fail_on_rank, (-1,)), ("failing", fail_on_rank, (1,)),
                   ("after", fail_on_rank, (-1,))])
    spawns.check("before")  # no rank fails: passes
    with pytest.raises(AssertionError, match=r"(?s)case failing failed on rank 1:.*rank 1 fails on purpose"):
        spawns.check("failing")
    # rank 0 is stopped in the barrier of "after" (or fails there: its peer is gone)
    with pytest.raises(AssertionError, match=r"case after (did not finish on ranks|failed on rank 0)"):
        spawns.check("after")
    with pytest.raises(AssertionError, match="no case 'never' was run"):
        spawns.check("never")
