"""Real multi-node layouts on one machine: one torchrun agent per node on loopback
(``--nnodes N --node_rank I --master_addr 127.0.0.1``), as users launch several nodes.

TorchRec sees nodes of ``LOCAL_WORLD_SIZE`` ranks there; every check fails if the
code under test assumes that one node holds every rank (``multinode_workers``).
"""

import os

import pytest

from dynamicemb.shard import host_ranks, threads_per_rank
from dynamicemb_testing.multinode import run_nodes

CHECKS = ["topology", "planner_memory", "plan_file_devices", "twins"]


@pytest.mark.parametrize("nnodes, nproc_per_node", [(2, 1), (2, 2)])
def test_multinode_layout(nnodes, nproc_per_node):
    outputs = run_nodes(nnodes, nproc_per_node, ["-m", "dynamicemb_testing.multinode_workers", *CHECKS])
    for node, output in enumerate(outputs):
        for local_rank in range(nproc_per_node):
            rank = node * nproc_per_node + local_rank
            for check in CHECKS:
                assert f"rank {rank}: {check} passed" in output, (node, rank, check)


def test_a_failing_worker_fails_the_launch_at_once():
    # Without the launcher stopping the surviving agent, node 0 would wait at
    # torchrun's exit barrier (5 minutes by default) and the launch would time out.
    with pytest.raises(AssertionError, match="fail_on_last_node failed") as failure:
        run_nodes(2, 1, ["-m", "dynamicemb_testing.multinode_workers", "fail_on_last_node"], timeout=120)
    assert "rank 1 fails on purpose" in str(failure.value)


def test_without_a_process_group_this_process_has_every_core():
    assert host_ranks() == [0]
    assert threads_per_rank() == len(os.sched_getaffinity(0))
