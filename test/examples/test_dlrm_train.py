"""The main job (examples/dlrm/train.py) at a tiny size: 2 gloo ranks under torchrun;
float32, bfloat16 and float16 (autocast) rows."""

import argparse
import json
import os
import re
import time

import pytest

from dynamicemb_testing.dlrm import load_dlrm_checkpoint, load_dlrm_data, torchrun
from dynamicemb_testing.scripts import TEST_DIR, run_python


# A server: only dynamicemb imported; each trained model's logits (an artifact per
# argument), at two batch sizes. One process serves both collections' artifacts (a
# process each cost 7 s more); one that fails prints why, and the next is still served.
_SERVER = """
import sys, traceback, torch
import dynamicemb  # registers the lookup op
for path in sys.argv[1:]:
    try:
        model = torch.export.load(path + "/model.pt2").module()
        sample = torch.load(path + "/sample.pt", weights_only=True)
        logits = model(sample["dense"], sample["ids"])
        torch.testing.assert_close(logits, sample["logits"], rtol=1e-5, atol=1e-6)
        half = sample["dense"].shape[0] // 2  # another batch size
        features = sample["ids"].numel() // sample["dense"].shape[0]
        ids = sample["ids"].reshape(features, -1)[:, :half].reshape(-1)
        torch.testing.assert_close(model(sample["dense"][:half], ids), sample["logits"][:half],
                                   rtol=1e-5, atol=1e-6)
        print("served", path, logits.shape[0], flush=True)
    except Exception:
        print("failed to serve", path, traceback.format_exc(), flush=True)
"""
COLLECTIONS = ["ebc", "ec"]
#: each collection's run stores its dynamic rows in (the served twin keeps them)
DTYPES = {"ebc": "fp32", "ec": "bf16"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """({collection: (its output folder, its job)}, the server's run over both artifacts)."""
    jobs = {}
    for collection in COLLECTIONS:
        out = tmp_path_factory.mktemp(collection)
        jobs[collection] = out, torchrun(
            "--num-samples", 40000, "--eval-samples", 8000, "--batch-size", 512, "--eval-every", 20,
            "--cache-fraction", 0.3, "--collection", collection, "--out", out,
            "--embedding-dtype", DTYPES[collection], "--serving-artifact", out / "serving")
    served = run_python(["-c", _SERVER, *(out / "serving" for out, _ in jobs.values())], timeout=600)
    return jobs, served


@pytest.mark.parametrize("collection", COLLECTIONS)
def test_training_learns_and_reports(trained, collection):
    (tmp_path, done), served = trained[0][collection], trained[1]
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = [loss for _, loss in summary["history"]["loss"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses  # the loss falls
    assert 0.6 < summary["eval_auc"] <= summary["bayes_auc"] + 0.02, summary["eval_auc"]
    assert summary["samples"] == 40000
    dynamic = summary["dynamic_tables"]
    assert dynamic and all(0 < t["rows"] <= t["max_rows"] for t in dynamic.values())
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[DTYPES[collection]]
    assert all(t["dtype"] == dtype for t in dynamic.values())
    # a cache of 30% of the rows: it evicted to the host store, and every id is kept
    assert all(t["evictions"] > 0 and 0 < t["hit_rate"] < 1 for t in dynamic.values())
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert "eval AUC" in done.stdout and "plot:" in done.stdout
    assert served.returncode == 0 and f"served {tmp_path / 'serving'} 512\n" in served.stdout, \
        served.stdout[-3000:] + served.stderr[-3000:]


def test_training_from_tsv_and_parquet_files(tmp_path):
    """The readers feed the job: files written from synthetic data, one a little
    corrupted (the malformed line is skipped; ranks stop together)."""
    dlrm_data = load_dlrm_data()
    data = dlrm_data.SyntheticCriteo(6000, 500, scale=0.05)
    train_tsv, eval_tsv = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    dlrm_data.write_tsv(str(train_tsv), data)
    with open(train_tsv, "a") as f:
        f.write("2\tnot a line\n")
    dlrm_data.write_tsv(str(eval_tsv), dlrm_data.SyntheticCriteo(2000, 500, scale=0.05, start=6000))
    parquet = tmp_path / "train.parquet"
    dlrm_data.write_parquet(str(parquet), data)
    for kind, files in (("tsv", train_tsv), ("parquet", parquet)):
        half = ("--embedding-dtype", "fp16", "--amp") if kind == "parquet" else ()
        done = torchrun("--data", kind, "--train-files", files, "--eval-files", eval_tsv if kind == "tsv"
                        else parquet, "--batch-size", 256, "--eval-every", 5, "--out", tmp_path / kind,
                        *half)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((tmp_path / kind / "summary.json").read_text())
        assert summary["samples"] >= 5000 and summary["eval_auc"] is not None
        dtypes = {t["dtype"] for t in summary["dynamic_tables"].values()}
        assert dtypes == {"float16" if half else "float32"}, dtypes


# bfloat16 rows: a resume must restore the update count their rounding bits follow
SMALL = ("--num-samples", 20000, "--eval-samples", 4000, "--batch-size", 512, "--eval-every", 5,
         "--cache-fraction", 0.3, "--embedding-dtype", "bf16")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The summary of one run of SMALL from start to end."""
    out = tmp_path_factory.mktemp("whole")
    whole = torchrun(*SMALL, "--out", out)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def assert_same_training(a, b, resumed_at: int) -> None:
    """Summaries ``a`` (uninterrupted) and ``b`` (resumed at step ``resumed_at``): the
    same loss at every step, the same eval AUCs and rows."""
    assert a["steps"] == b["steps"] > resumed_at and a["samples"] == b["samples"] == 20000
    assert a["history"]["loss"] == b["history"]["loss"]
    assert [x for x in b["history"]["auc"] if x[0] != resumed_at] == a["history"]["auc"]
    assert {n: t["rows"] for n, t in a["dynamic_tables"].items()} == \
        {n: t["rows"] for n, t in b["dynamic_tables"].items()}


def test_a_resumed_run_trains_exactly_as_an_uninterrupted_one(tmp_path, uninterrupted):
    """Stopped at step 12 (checkpoints at 4, 8, 12 in alternating slots), resumed to the
    end: the same loss at every step, the same eval AUC and rows as one run."""
    ckpt = tmp_path / "ckpt"
    first = torchrun(*SMALL, "--out", tmp_path / "first", "--max-steps", 12,
                     "--checkpoint-dir", ckpt, "--checkpoint-every", 4)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 12
    assert {p.name for p in ckpt.iterdir()} == {"a", "b", "latest.json"}
    rest = torchrun(*SMALL, "--out", tmp_path / "rest", "--checkpoint-dir", ckpt, "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_same_training(uninterrupted, json.loads((tmp_path / "rest" / "summary.json").read_text()), 12)
    # A resume that would build another model is refused, naming the argument, and so
    # is a broken record: checked on the job's own checkpoint module, which refuses
    # before it touches the model (two more 2-rank jobs took 26 s); that the job ends
    # non-zero on such a refusal is test_checkpoint_flags_are_checked's.
    checkpoint = load_dlrm_checkpoint()
    recorded = json.loads((ckpt / "latest.json").read_text())["model_args"]
    assert (recorded["embedding_dim"], recorded["dense_arch"]) == (16, "64,16")
    other = argparse.Namespace(**dict(recorded, embedding_dim=8, dense_arch="64,8"))
    with pytest.raises(ValueError, match=re.escape("--embedding-dim 16 (now 8)")):
        checkpoint.load(str(ckpt), None, None, other)
    (ckpt / "latest.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a checkpoint record"):
        checkpoint.load(str(ckpt), None, None, argparse.Namespace(**recorded))


def test_checkpoint_flags_are_checked(tmp_path):
    done = torchrun("--resume", timeout=120)
    assert done.returncode != 0 and "need --checkpoint-dir" in done.stderr
    done = torchrun(*SMALL, "--checkpoint-dir", tmp_path / "empty", "--resume", "--out", tmp_path)
    assert done.returncode != 0 and "holds no checkpoint" in done.stderr


def test_a_rank_killed_inside_the_all_to_all_ends_the_job_and_resume_continues(
        tmp_path, uninterrupted, monkeypatch):
    """Rank 1 is SIGKILLed in the all-to-all of step 9 (``fault_injection``), after the
    checkpoint of step 8: the job ends within seconds (exit status non-zero; the
    process-group timeout is 20 s, torchrun stops the others), the step-8 checkpoint
    is intact, and ``--resume`` trains to the same losses and rows as one run."""
    monkeypatch.setenv("PYTHONPATH", os.path.join(TEST_DIR, "dynamicemb_testing", "fault_injection"))
    ckpt = tmp_path / "ckpt"
    killed = torchrun(*SMALL, "--out", tmp_path / "killed", "--checkpoint-dir", ckpt,
                      "--checkpoint-every", 4, "--pg-timeout", 20, timeout=300,
                      env=dict(DYNAMICEMB_KILL_RANK="1", DYNAMICEMB_KILL_DIR=str(ckpt),
                               DYNAMICEMB_KILL_AFTER_STEP="8"))
    ended = time.time()
    assert killed.returncode != 0 and (ckpt / "killed_at").exists(), killed.stderr[-3000:]
    assert "exitcode  : -9" in killed.stderr, killed.stderr[-3000:]  # torchrun saw the SIGKILL
    assert ended - float((ckpt / "killed_at").read_text()) < 60
    assert json.loads((ckpt / "latest.json").read_text())["step"] == 8
    monkeypatch.undo()  # the resume runs without the fault injection
    rest = torchrun(*SMALL, "--out", tmp_path / "rest", "--checkpoint-dir", ckpt, "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_same_training(uninterrupted, json.loads((tmp_path / "rest" / "summary.json").read_text()), 8)
