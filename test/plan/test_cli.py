"""``python -m dynamicemb.plan``: every subcommand, and one error line with exit code 2."""

import json

import pytest

from dynamicemb.plan.cli import main
from dynamicemb.plan.format import load_plan
from dynamicemb.plan.generators import distributed, dp_and_localized, greedy
from dynamicemb_testing.plan_testing import CRITEO_SIZES, EXAMPLE_MIXED
from dynamicemb_testing.scripts import run_python

CRITEO = ",".join(map(str, CRITEO_SIZES))
GREEDY = ["generate", "greedy", "--table-sizes", "10,20", "--num-gpus", "2"]


@pytest.fixture
def mixed_plan(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(EXAMPLE_MIXED)
    return str(path)


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``main(argv)``."""
    code = main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(err, *fragments):
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err


@pytest.mark.parametrize("strategy, extra, expected", [
    ("dp_and_localized", [], dp_and_localized(CRITEO_SIZES, 8)),
    ("dp_and_localized", ["--dp-threshold", "100000"], dp_and_localized(CRITEO_SIZES, 8, 100000)),
    ("distributed", ["--spelling", "old"], distributed(CRITEO_SIZES, 8)),
    ("greedy", ["--dim", "128", "--memory-per-gpu", 10 ** 9],
     greedy([size * 128 * 4 for size in CRITEO_SIZES], 8, 10 ** 9)),
])
def test_generate(capsys, tmp_path, strategy, extra, expected):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "generate", strategy, "--table-sizes", CRITEO, "--num-gpus", 8, "-o", path,
                         *extra)
    assert (code, err) == (0, "")
    assert out == f"wrote {path}: 8 GPUs, 26 lookups placed\n"
    assert load_plan(path) == expected
    text = path.read_text()
    sharded_new = strategy == "distributed" and "old" not in extra
    assert ("num_sharding" in text) == ("old" in extra) and ("shards_count" in text) == sharded_new


def test_generate_to_stdout(capsys):
    code, out, _ = run(capsys, "generate", "distributed", "--table-sizes", "10,20", "--num-gpus", 2)
    assert code == 0 and load_plan(out) == distributed([10, 20], 2)


def test_validate(capsys, mixed_plan):
    assert run(capsys, "validate", mixed_plan) == (0, "ok: 2 GPUs, 5 lookups placed\n", "")
    assert run(capsys, "validate", mixed_plan, "--world-size", 2, "--num-lookups", 5)[0] == 0
    code, out, err = run(capsys, "validate", mixed_plan, "--world-size", 3)
    assert (code, out) == (2, "")
    assert_one_error_line(err, "plan has 2 GPUs, the world size is 3")
    code, _, err = run(capsys, "validate", mixed_plan, "--num-lookups", 7)
    assert code == 2
    assert_one_error_line(err, "lookup 5 is placed nowhere")


def test_show(capsys, mixed_plan):
    code, out, err = run(capsys, "show", mixed_plan)
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        f"{mixed_plan}: 2 GPUs, 2 groups",
        "GPU 0", "  group 0  mp  lookups [0, 2]", "  group 1  dp  lookups [4]",
        "GPU 1", "  group 0  mp  lookups [1, 3]", "  group 1  dp  lookups [4]",
    ]


def test_show_estimates_bytes(capsys, mixed_plan, tmp_path):
    # Tables of 10..50 rows, dim 2: 80, 160, 240, 320, 400 bytes. GPU 0: 80 + 240 + 400 (dp).
    code, out, _ = run(capsys, "show", mixed_plan, "--table-sizes", "10,20,30,40,50", "--dim", 2)
    assert code == 0
    assert [line for line in out.splitlines() if line.startswith("GPU")] == [
        "GPU 0  ~720 bytes (0.0 MiB)", "GPU 1  ~880 bytes (0.0 MiB)"]
    # Row-wise: each of the 2 GPUs holds half of every table: (40 + 80) / 2 bytes.
    path = tmp_path / "rw.json"
    path.write_text(distributed([10, 20], 2).to_json())
    code, out, _ = run(capsys, "show", path, "--table-sizes", "10,20", "--dim", 1)
    assert code == 0 and "GPU 1  ~60 bytes" in out and "  group 0  mp  shard 1/2  lookups [0, 1]" in out
    # 16-bit rows: half the bytes
    code, out, _ = run(capsys, "show", path, "--table-sizes", "10,20", "--dim", 1,
                       "--embedding-dtype", "bf16")
    assert code == 0 and "GPU 1  ~30 bytes" in out


@pytest.mark.parametrize("argv, fragments", [
    (["show", "{plan}", "--dim", "4"], ["--table-sizes and --dim go together"]),
    (["show", "{plan}", "--table-sizes", "10,20", "--dim", "4"], ["lookup 2 has no table size"]),
    (GREEDY, ["greedy needs --dim and --memory-per-gpu"]),
    (GREEDY + ["--dim", "4", "--memory-per-gpu", "100"], ["table 1 (320 bytes) fits on no GPU"]),
    (["generate", "distributed", "--table-sizes", "10,x", "--num-gpus", "2"], ["--table-sizes: expected"]),
    (["generate", "distributed", "--table-sizes", "10", "--num-gpus", "0"], ["num_gpus must be a positive"]),
    (["validate", "{missing}"], ["No such file or directory", "missing.json"]),
])
def test_bad_arguments(capsys, mixed_plan, tmp_path, argv, fragments):
    argv = [arg.format(plan=mixed_plan, missing=tmp_path / "missing.json") for arg in argv]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert_one_error_line(err, *fragments)


@pytest.mark.parametrize("content, fragments", [
    ("[[{", ["not valid JSON"]),
    (json.dumps([[{"local_embedding_list": [0, "x"], "table_placement_strategy": "mp"}]]),
     ['plan[0][0]["local_embedding_list"][1]: expected a non-negative integer, got "x"']),
    (json.dumps([[{"local_embedding_list": [0], "table_placement_strategy": "rw"}]]),
     ["GPU 0 group 0: unknown strategy 'rw'"]),
])
@pytest.mark.parametrize("command", ["show", "validate", "translate"])
def test_broken_file(capsys, tmp_path, command, content, fragments):
    path = tmp_path / "broken.json"
    path.write_text(content)
    code, out, err = run(capsys, command, path)
    assert (code, out) == (2, "")
    assert_one_error_line(err, *fragments)


def test_argparse_errors_exit_2(capsys):
    for argv in ([], ["generate", "column_wise", "--table-sizes", "1", "--num-gpus", "1"], ["validate"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    capsys.readouterr()


def test_module_help():
    done = run_python(["-m", "dynamicemb.plan", "--help"], env=dict(PYTHONWARNINGS="ignore"), timeout=120)
    assert done.returncode == 0
    assert "usage: python -m dynamicemb.plan" in done.stdout
    assert "examples:" in done.stdout and "generate greedy" in done.stdout


def test_translate(capsys, tmp_path):
    """The seed's mixed example: lookups 1 and 3 share table t1 (table-wise on GPU 1),
    lookup 4 data parallel; t1 dynamic gets the customized kernel."""
    path = tmp_path / "mixed.json"
    path.write_text(EXAMPLE_MIXED)
    code, out, err = run(capsys, "translate", path, "--lookups", "a,b,c,d,e", "--tables",
                         "t0,t1,t2,t1,t3", "--table-sizes", "10,20,30,20,40", "--dim", "8",
                         "--dynamic", "t1")
    assert (code, err) == (0, "")
    rows = {}  # the first table printed: param | sharding type | compute kernel | ranks
    for line in out.splitlines():
        if line.count("|") == 3 and "sharding type" not in line:
            cells = [c.strip() for c in line.split("|")]
            rows.setdefault(cells[0], cells[1:])
    assert rows["t0"] == ["table_wise", "fused", "[0]"]
    assert rows["t1"] == ["table_wise", "customized_kernel", "[1]"]
    assert rows["t2"] == ["table_wise", "fused", "[0]"]
    assert rows["t3"][0] == "data_parallel"


def test_translate_refuses_what_cannot_be_expressed(capsys, tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text(EXAMPLE_MIXED)
    code, out, err = run(capsys, "translate", path, "--tables", "t0,t1,t2,t1,t3", "--dynamic", "t3")
    assert (code, out) == (2, "")
    assert_one_error_line(err, "'t3' is dynamic but placed data parallel")
