"""DMP state dicts carry dynamic tables through torch.distributed.checkpoint: saved
on 2 gloo ranks and loaded on 2 and on 1, saved on 1 and loaded on 2, each followed
by training equal to the uninterrupted run; a mixed static + dynamic collection
with either optimizer enum; a pickled state dict (torch.save, then DynamicEmbDump:
upstream's example's order) restores the tables exactly, and is refused on another
rank or optimizer; bfloat16 tables round-trip bit for bit and float32 tables refuse
them. One 2-rank spawn."""

from dynamicemb_testing import state_dict_workers
from dynamicemb_testing.dist_utils import run_distributed


def test_dcp_round_trips_reshard_and_resume(tmp_path):
    run_distributed(state_dict_workers.dcp_round_trips, 2, str(tmp_path))
