"""The main job (examples/dlrm/train.py) on data it cannot use: one clear message naming
the file and the reason, the same on every rank, exit status 1, no traceback, no hang."""

import re

import pytest

from dynamicemb_testing.dist_utils import run_distributed
from dynamicemb_testing.dlrm import load_dlrm_data, torchrun
from dynamicemb_testing.dlrm_error_workers import data_errors

pytestmark = pytest.mark.distributed


def assert_every_rank_says(stderr: str, message: str) -> None:
    """Each of the 2 ranks printed ``error: message`` (rank 0's progress bar may share
    the line), and no rank printed another error."""
    assert stderr.count(f"error: {message}\n") == 2, stderr[-3000:]
    assert len(re.findall(r"error: ", stderr)) == 2, stderr[-3000:]


def assert_no_worker_traceback(stderr: str) -> None:
    """Only torchrun's agent may print a traceback (its ChildFailedError), never a rank."""
    assert "train.py\", line" not in stderr and "data.py\", line" not in stderr, stderr[-3000:]
    assert "IndexError" not in stderr, stderr[-3000:]


def test_a_csv_with_a_header_names_the_file_and_the_reason(tmp_path):
    """The issue's case: a CSV with a header, 201 lines, all malformed as TSV."""
    path = tmp_path / "day.csv"
    header = ",".join(["label"] + [f"i{j}" for j in range(1, 14)] + [f"c{j}" for j in range(1, 27)])
    path.write_text("\n".join([header] + [",".join(["0"] * 14 + ["68fd1e64"] * 26)] * 200) + "\n")
    done = torchrun("--data", "tsv", "--train-files", path, "--out", tmp_path / "out", timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert_every_rank_says(done.stderr, f"--train-files {path}: no usable row: all 201 rows are "
                           f"malformed (the first: line {path}:1 (wrong field count))")
    assert_no_worker_traceback(done.stderr)
    assert not (tmp_path / "out").exists()


def test_an_eval_set_of_one_class_is_refused_at_the_first_evaluation(tmp_path):
    dlrm_data = load_dlrm_data()
    data = dlrm_data.SyntheticCriteo(1000, 250, scale=0.02)
    train, evals = tmp_path / "train.tsv", tmp_path / "eval.tsv"
    dlrm_data.write_tsv(str(train), data)
    one_class = dlrm_data.SyntheticCriteo(300, 100, scale=0.02, start=1000)
    dlrm_data.write_tsv(str(evals), [b._replace(labels=b.labels * 0) for b in one_class])
    done = torchrun("--data", "tsv", "--train-files", train, "--eval-files", evals, "--batch-size", 250,
                    "--eval-every", 1, "--out", tmp_path / "out", timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert_every_rank_says(done.stderr, f"--eval-files {evals}: all 300 eval rows have label 0; "
                           f"the AUC needs both classes and is undefined")
    assert_no_worker_traceback(done.stderr)


def test_missing_empty_unusable_and_too_small_files_and_a_failing_reader(tmp_path):
    """Each rank reaches the same ``DataError``; a reader failing on one rank mid-pass
    stops every rank at the same step (``dlrm_error_workers``)."""
    dlrm_data = load_dlrm_data()
    good, one_row, empty, bad = (tmp_path / n for n in ("good.tsv", "one.tsv", "empty.tsv", "bad.tsv"))
    dlrm_data.write_tsv(str(good), dlrm_data.SyntheticCriteo(40, 20, scale=0.01))
    dlrm_data.write_tsv(str(one_row), dlrm_data.SyntheticCriteo(1, 1, scale=0.01))
    empty.write_bytes(b"")
    bad.write_text("1\tnot\ta\tcriteo\tline\n" * 3)
    missing = tmp_path / "no_such.tsv"
    tsv = ["--data", "tsv", "--train-files"]
    cases = [
        (tsv + [f"{good},{missing}"], [f"--train-files {missing}: no such file"]),
        (tsv + [str(empty)], [f"--train-files {empty}: the file is empty"]),
        (tsv + [str(tmp_path)], [f"--train-files {tmp_path}: is a directory"]),
        (tsv + [str(bad)], [f"--train-files {bad}: no usable row: all 3 rows are malformed",
                            f"line {bad}:1 (wrong field count)"]),
        (tsv + [str(one_row)], [f"--train-files {one_row}: fewer usable rows than ranks: "
                                "1 of 2 ranks get none"]),
        (tsv + [str(good), "--eval-files", str(empty)], [f"--eval-files {empty}: the file is empty"]),
        (tsv + [str(good), "--eval-files", str(one_row)], [f"--eval-files {one_row}: fewer usable rows"]),
        (["--num-samples", "1"], ["--num-samples 1: fewer usable rows than ranks"]),
        (["--data", "parquet", "--train-files", str(good)], [f"--train-files {good}: ", "Parquet"]),
    ]
    run_distributed(data_errors, 2, [([str(a) for a in argv], needles) for argv, needles in cases])
