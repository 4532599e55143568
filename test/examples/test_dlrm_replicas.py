"""The DLRM job with hot-row replicas (train.py --replicas) on 2 gloo ranks: the same
loss and AUC as without (staleness 0, bit for bit with dedup), fewer ids across
ranks, the replicas' traffic reported; refused for an EmbeddingBagCollection whose
row-wise sharding mixes static tables (no dedup path)."""

import json

import pytest

from dynamicemb_testing.dlrm import torchrun

JOB = ("--collection", "ec", "--num-samples", 20480, "--eval-samples", 4096, "--batch-size", 512,
       "--eval-every", 10, "--score-strategy", "lfu")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas_job")
    return {name: (tmp / name, torchrun(*JOB, "--out", tmp / name, *extra)) for name, extra in
            (("plain", ()), ("replicated", ("--replicas", 0.02, "--replicas-refresh", 5)))}


def test_replicated_job_trains_exactly_as_without_and_sends_fewer_ids(runs):
    summaries = {}
    for name, (out, done) in runs.items():
        assert done.returncode == 0, done.stderr[-3000:]
        assert "bytes/step (estimated, all ranks)" in done.stdout, done.stdout[-2000:]
        summaries[name] = json.loads((out / "summary.json").read_text())
    plain, replicated = summaries["plain"], summaries["replicated"]
    assert replicated["history"]["loss"] == plain["history"]["loss"]
    assert replicated["eval_auc"] == plain["eval_auc"]
    traffic, before = replicated["history"]["traffic_per_step"], plain["history"]["traffic_per_step"]
    assert traffic["replicated_ids"] > 0 and traffic["replica_sync_bytes"] > 0, traffic
    assert before["replicated_ids"] == 0 and before["replica_sync_bytes"] == 0, before
    assert traffic["alltoall_dynamic_ids"] < before["alltoall_dynamic_ids"], (traffic, before)


def test_replicas_of_an_embedding_bag_collection_without_dedup_path_are_refused(tmp_path):
    done = torchrun("--collection", "ebc", "--num-samples", 2048, "--batch-size", 512,
                    "--replicas", 4, "--out", tmp_path)
    assert done.returncode != 0
    assert "replicas of EmbeddingBagCollection tables need the dedup path" in done.stderr, \
        done.stderr[-3000:]
