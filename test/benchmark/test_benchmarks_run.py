"""The benchmark scripts run end to end at a tiny scale and write what they promise.
Timings are not checked here: targets live in the benchmarks and benchmark/RESULTS.md."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script, *args):
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmark", script), *args],
                   check=True, cwd=ROOT, capture_output=True, timeout=600)


def test_hash_table_benchmark(tmp_path):
    out = str(tmp_path / "ht")
    run("benchmark_hash_table.py", "--capacity", "8192", "--batch", "1024", "--reps", "2",
        "--loads", "0.5", "1.0", "--dims", "8", "--out", out)
    rows = json.load(open(out + ".json"))["rows"]
    assert [(r["load"], r["dim"]) for r in rows] == [(0.5, 8), (1.0, 8)]
    assert all(r["ratio_find_gather_over_gather"] > 0 and r["metadata_bytes_per_slot"] < 24
               for r in rows)
    assert "| load | dim |" in open(out + ".md").read()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_batched_tables_benchmark(tmp_path, optimizer):
    out = str(tmp_path / "bt")
    run("benchmark_batched_dynamicemb_tables.py", "--batch_sizes", "256", "--num_embeddings",
        "4096", "--optimizers", optimizer, "--num_iterations", "2", "--warmup", "1",
        "--cache_fractions", "0.5", "--embedding_dim", "16", "--out", out)
    rows = json.load(open(out + ".json"))["rows"]
    assert [r["caching"] for r in rows] == [False, True]
    has_torchrec = optimizer != "adam"  # FBGEMM has no Adam on CPU
    assert all((r["train(torchrec)"] is not None) == has_torchrec for r in rows)
    assert all((r["train_ratio_paired(dynamicemb/torchrec)"] is not None) == has_torchrec
               for r in rows)
    assert 0 <= rows[1]["cache_hit_rate"] <= 1
    assert os.path.getsize(out + ".png") > 0


def test_checkpoint_benchmark(tmp_path):
    out = str(tmp_path / "ck.json")
    run("benchmark_checkpoint.py", "--rows", "5000", "--dim", "8", "--out", out)
    result = json.load(open(out))
    row_bytes = 8 + 8 + 4 * 8 * 3  # key, score, embedding and Adam states
    assert result["rows"] == 5000 and 0 <= result["bytes"] - 5000 * row_bytes < 10_000  # + manifest
    assert result["dump_rows_per_s"] > 0 and result["load_rows_per_s"] > 0
