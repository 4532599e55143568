"""A cluster with a real network on one machine (``benchmark/cluster/netns_cluster.sh``):
two nodes in network namespaces joined by links shaped to 1 Gbit/s, one torchrun agent
in each. The same job trains to the same result as on loopback, its bytes cross the
links, and the namespaces are gone afterwards, also when the job fails. Skipped with
the reason where the machine lacks root or iproute2."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from dynamicemb_testing.multinode import run_nodes
from dynamicemb_testing.scripts import ROOT, script_env

SCRIPT = os.path.join(ROOT, "benchmark", "cluster", "netns_cluster.sh")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="network namespaces need root and iproute2 (ip, tc)")


def _namespaces(prefix: str):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def _cluster(prefix: str, *job: str, limit: int = 240) -> subprocess.CompletedProcess:
    env = script_env(PYTHONWARNINGS="ignore", PYTHON=sys.executable)
    return subprocess.run(["bash", SCRIPT, "--nodes", "2", "--ranks-per-node", "1", "--rate",
                           "1gbit", "--prefix", prefix, "--time-limit", str(limit), "--", *job],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=limit + 60)


def _digests(text: str):
    return dict(re.findall(r"rank (\d+): digest ([0-9a-f]{64})", text))


def test_a_two_node_job_over_shaped_links_equals_loopback():
    job = ["-m", "dynamicemb_testing.multinode_workers", "digest"]
    loopback = _digests("".join(run_nodes(2, 1, job, timeout=240)))
    done = _cluster("dembt", *job)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _digests(done.stdout) == loopback and len(loopback) == 2
    sent = [int(tx) for tx in re.findall(r"node \d link bytes: tx (\d+) rx \d+", done.stdout)]
    assert len(sent) == 2 and min(sent) > 10_000, done.stdout[-2000:]  # the job's bytes crossed
    assert _namespaces("dembt") == []


def test_the_namespaces_are_gone_after_a_failing_job():
    done = _cluster("dembf", "-m", "dynamicemb_testing.multinode_workers", "fail_on_last_node")
    assert done.returncode != 0
    assert "rank 1 fails on purpose" in done.stdout + done.stderr
    assert _namespaces("dembf") == []


def test_refusals_name_the_cause():
    done = subprocess.run(["bash", SCRIPT, "--nodes", "1", "--", "x.py"], capture_output=True,
                          text=True)
    assert done.returncode == 2 and "--nodes 2..16" in done.stderr
    done = subprocess.run(["bash", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 2 and "give the job after --" in done.stderr
