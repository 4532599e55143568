"""Memory of repeated model builds in one process (upstream's test_twin_module builds
48 twin pairs in one pytest process): each dropped build's memory comes back."""

from dynamicemb_testing import build_workers
from dynamicemb_testing.dist_utils import run_distributed

#: MiB the trimmed resident size may grow over the builds after the first: well
#: under one build's dynamic table (64 MiB of rows and 64 MiB of Adagrad state).
BOUND_MB = 48


def test_ten_twin_builds_return_their_memory():
    run_distributed(build_workers.repeated_twin_builds, 2, 10, BOUND_MB)
