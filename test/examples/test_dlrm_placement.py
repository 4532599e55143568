"""The DLRM job with a graph-partitioned placement (examples/dlrm/partition.py, then
train.py --placement) on 2 gloo ranks: it trains, reports the all-to-all, sends fewer
ids across ranks than the hash placement, and refuses a file for another world size."""

import json

import pytest

from dynamicemb_testing.dlrm import torchrun
from dynamicemb_testing.scripts import run_python

SAMPLES = 20480
JOB = ("--num-samples", SAMPLES, "--eval-samples", 4096, "--batch-size", 512, "--eval-every", 10)


def _partition(path, world_size: int) -> dict:
    done = run_python(["examples/dlrm/partition.py", "--world-size", world_size, "--samples",
                       SAMPLES, "-o", path], timeout=300, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement_job")
    stats = _partition(tmp / "p2.npz", 2)
    jobs = {name: torchrun(*JOB, "--out", tmp / name, *extra) for name, extra in
            (("hash", ()), ("placed", ("--placement", tmp / "p2.npz")))}
    return tmp, stats, jobs


def test_partition_keeps_more_lookups_local_than_the_hash(runs):
    _, stats, _ = runs
    assert stats["ids_placed"] > 1000 and sum(stats["samples_per_rank"]) == SAMPLES
    assert stats["local_fraction"] > stats["hash_local_fraction"] + 0.05, stats


def test_placed_job_trains_and_sends_fewer_ids(runs):
    tmp, _, jobs = runs
    summaries = {}
    for name, done in jobs.items():
        assert done.returncode == 0, done.stderr[-3000:]
        assert "all-to-all:" in done.stdout and "eval AUC" in done.stdout, done.stdout[-2000:]
        summaries[name] = json.loads((tmp / name / "summary.json").read_text())
    placed, hashed = summaries["placed"], summaries["hash"]
    assert placed["steps"] == hashed["steps"] == SAMPLES // 1024
    assert 0.6 < placed["eval_auc"] and abs(placed["eval_auc"] - hashed["eval_auc"]) < 0.02
    sent = {n: s["history"]["alltoall_dynamic_ids_per_step"] for n, s in summaries.items()}
    assert 0 < sent["placed"] < 0.9 * sent["hash"], sent
    every = {n: s["history"]["alltoall_ids_per_step"] for n, s in summaries.items()}
    assert all(every[n] > sent[n] for n in sent), every  # static tables' ids come on top


def test_a_file_for_another_world_size_is_refused(runs):
    tmp, _, _ = runs
    _partition(tmp / "p4.npz", 4)
    done = torchrun(*JOB, "--out", tmp / "bad", "--placement", tmp / "p4.npz", timeout=300)
    assert done.returncode != 0
    assert "places ids over 4 ranks" in done.stderr and "p4.npz" in done.stderr, done.stderr[-3000:]
