"""Upstream dynamicemb's example flow, written with upstream's API, on 2 gloo ranks:
planner with ``eb_configs`` and a ``DynamicEmbeddingEnumerator``, constraints with
``global_hbm_for_values`` and ``KVCounter`` admission, DMP, caching and TorchRec's
prefetch pipeline, ``DynamicEmbDump`` / ``DynamicEmbLoad``, ``get_score`` and
``incremental_dump`` (checks in ``dynamicemb_testing.upstream_flow_workers``)."""

from dynamicemb_testing import upstream_flow_workers
from dynamicemb_testing.dist_utils import run_distributed


def test_upstream_example_flow_runs_with_only_the_device_changed(tmp_path):
    run_distributed(upstream_flow_workers.upstream_flow, 2, str(tmp_path))
