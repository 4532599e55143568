"""The DLRM job with a graph-partitioned placement (examples/dlrm/partition.py, then
train.py --placement) on 2 gloo ranks: it trains, reports the all-to-all, sends fewer
ids across ranks than the hash placement, with stale hot-row replicas fewer still (the
ids a partition left out for them, listed in its file, given no vote by the routing),
and refuses a file for another world size, or --replicas placement with a file that
lists no replicated ids."""

import json
import os

import pytest

from dynamicemb_testing.dlrm import torchrun
from dynamicemb_testing.scripts import ROOT, run_python

SAMPLES = 20480
JOB = ("--num-samples", SAMPLES, "--eval-samples", 4096, "--batch-size", 512, "--eval-every", 10)


def _partition(path, world_size: int, *extra) -> dict:
    done = run_python(["examples/dlrm/partition.py", "--world-size", world_size, "--samples",
                       SAMPLES, "-o", path, *extra], timeout=300, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement_job")
    stats = _partition(tmp / "p2.npz", 2)
    _partition(tmp / "p2_replicas.npz", 2, "--replicas", 0.02)
    ec = ("--collection", "ec", "--score-strategy", "lfu")
    jobs = {name: torchrun(*JOB, "--out", tmp / name, *extra) for name, extra in
            (("hash", ()), ("placed", ("--placement", tmp / "p2.npz")),
             ("placed_ec", (*ec, "--placement", tmp / "p2.npz")),
             ("placed_ec_replicas", (*ec, "--placement", tmp / "p2_replicas.npz",
                                     "--replicas", "placement", "--staleness", 5)))}
    return tmp, stats, jobs


def test_partition_keeps_more_lookups_local_than_the_hash(runs):
    _, stats, _ = runs
    assert stats["ids_placed"] > 1000 and sum(stats["samples_per_rank"]) == SAMPLES
    assert stats["local_fraction"] > stats["hash_local_fraction"] + 0.05, stats


def test_placed_job_trains_and_sends_fewer_ids(runs):
    tmp, _, jobs = runs
    summaries = _summaries(tmp, jobs)
    placed, hashed = summaries["placed"], summaries["hash"]
    assert placed["steps"] == hashed["steps"] == SAMPLES // 1024
    assert 0.6 < placed["eval_auc"] and abs(placed["eval_auc"] - hashed["eval_auc"]) < 0.02
    sent = {n: s["history"]["alltoall_dynamic_ids_per_step"] for n, s in summaries.items()}
    assert 0 < sent["placed"] < 0.9 * sent["hash"], sent
    # replicas on top (the ids the partition left out, from the file): their ids leave
    # the all-to-all, the partition and the routing ignore them
    assert 0 < sent["placed_ec_replicas"] < 0.85 * sent["placed_ec"], sent
    traffic = summaries["placed_ec_replicas"]["history"]["traffic_per_step"]
    assert traffic["replicated_ids"] > 0 and 0 < traffic["replica_rows"] < traffic["replicated_ids"]
    assert abs(summaries["placed_ec_replicas"]["eval_auc"] - summaries["placed_ec"]["eval_auc"]) < 0.02
    every = {n: s["history"]["alltoall_ids_per_step"] for n, s in summaries.items()}
    assert all(every[n] > sent[n] for n in sent), every  # static tables' ids come on top


def _summaries(tmp, jobs) -> dict:
    summaries = {}
    for name, done in jobs.items():
        assert done.returncode == 0, done.stderr[-3000:]
        assert "all-to-all:" in done.stdout and "eval AUC" in done.stdout, done.stdout[-2000:]
        summaries[name] = json.loads((tmp / name / "summary.json").read_text())
    return summaries


def test_a_file_for_another_world_size_is_refused(runs):
    tmp, _, _ = runs
    _partition(tmp / "p4.npz", 4)
    done = torchrun(*JOB, "--out", tmp / "bad", "--placement", tmp / "p4.npz", timeout=300)
    assert done.returncode != 0
    assert "places ids over 4 ranks" in done.stderr and "p4.npz" in done.stderr, done.stderr[-3000:]
    done = torchrun(*JOB, "--out", tmp / "none", "--collection", "ec", "--placement",
                    tmp / "p2.npz", "--replicas", "placement", timeout=300)
    assert done.returncode != 0
    assert "lists no replicated ids" in done.stderr and "p2.npz" in done.stderr, done.stderr[-3000:]


_ROUTED = """
import sys, torch
from data import CriteoTsvReader, SyntheticCriteo, write_tsv
from partition import RoutedBatches
from dynamicemb.placement import owner_rank, table_placement
path, tsv = sys.argv[1], sys.argv[2]
write_tsv(tsv, SyntheticCriteo(2048, 512, scale=0.05))
placements = {f: table_placement(path, f"t_cat_{f}", 2) for f in (0, 9, 10, 11, 19, 20, 21, 22)}
ranks = [list(RoutedBatches(CriteoTsvReader([tsv], 1024), placements, r, 2)) for r in (0, 1)]
try:
    len(RoutedBatches(CriteoTsvReader([tsv], 1024), placements, 0, 2))
except TypeError:
    pass
else:
    raise AssertionError("a streaming reader has no length")
whole = [b.sparse for b in CriteoTsvReader([tsv], 1024)]
assert len(ranks[0]) == len(ranks[1]) == len(whole) == 2
for step, batch in enumerate(whole):
    mine = [r[step].sparse for r in ranks]
    assert mine[0].shape == mine[1].shape == (512, 26)
    got = torch.cat(mine)
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, batch.tolist()))  # a split
    local = sum(int((owner_rank(m[:, f], 2, "hash", p) == r).sum())
                for r, m in enumerate(mine) for f, p in placements.items())
    share = local / (1024 * len(placements))
    assert share > 0.55, share  # the hash and an unrouted split: 0.5
    print("routed", step, share, flush=True)
"""


def test_the_tsv_reader_routes_samples_by_the_placement(runs):
    tmp, _, _ = runs
    done = run_python(["-c", _ROUTED, tmp / "p2.npz", tmp / "day.tsv"],
                      cwd=os.path.join(ROOT, "examples", "dlrm"),
                      timeout=300, check=True)
    assert done.stdout.count("routed") == 2, done.stdout
