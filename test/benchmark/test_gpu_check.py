"""``make gpu-check`` without a GPU: its dry run (``GPU_DRY_RUN=1``) runs run A's stages
and the stages of run B whose code A does not run, on the CPU at tiny sizes (the
CUDA path emulated, the graph stand-in), so that the first GPU run is no script's
first run; the stage plumbing (timeouts, the deadline, the records) and the GPU
scripts' checks fail when they should (a wrong replay, a sync, a layout kept alive
into the next)."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dynamicemb_testing.scripts import ROOT, script_env

BENCHMARK = os.path.join(ROOT, "benchmark")
RUN_A = ["build", "steps", "twins", "wide_dims", "memcheck", "tables_8m", "caching_64m",
         "hash", "hash_64m"]
RUN_B = ["build", "racecheck", "synccheck", "suites", "tables_1m", "tables_64m",
         "caching_adam", "hash_grid", "hash_grid_64m", "profile"]
# run B's stages that run a script path run A does not (the others differ from A's
# by arguments only: the sanitizer's tool, the batch, the rows; the build is A's)
B_ONLY = ["suites", "caching_adam", "hash_grid", "profile"]
LAYOUTS = ["all-hbm", "cache", "placed", "host-rows"]


def gpu_check(out, timeout=600, **env) -> subprocess.CompletedProcess:
    """``bash benchmark/gpu_check.sh`` as a dry run into ``out``, with ``env`` added."""
    env = script_env(GPU_DRY_RUN="1", OUT=str(out), PYTHON=sys.executable, **env)
    return subprocess.run(["bash", os.path.join(BENCHMARK, "gpu_check.sh")], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def stages(out) -> dict:
    """stage name -> its record (stages/<name>.json)."""
    folder = out / "stages"
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def jsonl(path) -> list:
    return [json.loads(line) for line in open(path)]


def test_dry_run_a_runs_every_stage_on_the_cpu(tmp_path):
    done = gpu_check(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    records = stages(tmp_path)
    assert sorted(records) == sorted(RUN_A)
    assert {r["status"] for r in records.values()} == {"ok"}, records
    assert all(r["dry_run"] and r["run"] == "A" for r in records.values())
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    names = [line.split()[0] for line in summary[:-1]]  # in the order they ended
    assert sorted(names) == sorted(RUN_A) and all("status=ok rc=0 seconds=" in line
                                                  for line in summary[:-1])
    assert [n for n in names if n != "build"] == RUN_A[1:]  # the build ends when it ends
    assert summary[-1].startswith("gpu-check run A: 9 stages, 0 not ok")
    # the step check: every layout and optimizer, syncs and a graph, all as expected
    steps = jsonl(tmp_path / "steps.jsonl")
    assert sorted((r["part"], r["layout"], r["optimizer"]) for r in steps) == sorted(
        (part, layout, opt) for part in ("syncs", "graph") for layout in LAYOUTS
        for opt in ("adam", "sgd"))
    assert all(r["ok"] for r in steps), [r for r in steps if not r["ok"]]
    assert all(r["profiler"]["window_found"] for r in steps if r["part"] == "syncs")
    assert all(r["rows_compared"] > 0 for r in steps if r["part"] == "graph")
    (wide,) = jsonl(tmp_path / "wide_dims.jsonl")
    assert wide["ok"] and sorted(wide["dims"]) == ["40", "8"]
    sweep = json.loads((tmp_path / "memcheck_sweep.json").read_text())
    assert sweep["not_launched"] == [] and all(n > 0 for n in sweep["launches"].values())
    # the twins' selection exists on the CPU too (its tests skip there)
    assert "tests collected" in (tmp_path / "twins.log").read_text()
    tables = json.loads((tmp_path / "gpu_tables_8M.json").read_text())["rows"]
    assert [(r["optimizer"], r["layout"]) for r in tables] == [
        (opt, layout) for opt in ("sgd", "adam") for layout in ("all-hbm", "all-hbm, CUDA graph")]
    (caching,) = json.loads((tmp_path / "gpu_caching_64M.json").read_text())["rows"]
    assert caching["layout"].startswith("cache") and "CUDA graph" in caching["layout"]
    assert 0 <= caching["cache hit rate"] <= 1
    for row in tables + [caching]:  # nothing of a layout outlives its row
        assert row["leaked_bytes"] == {} and row["held_bytes_after"] == row["held_bytes_before"]
        assert row["train(dynamicemb)"] > 0 and row["train(static)"] > 0
    for name in ("hash_table_1M", "hash_table_64M"):
        (row,) = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        assert (row["load"], row["dim"]) == (0.75, 8) and row["find_or_insert_mkeys_s"] > 0


def test_dry_run_b_runs_the_stages_whose_code_a_does_not(tmp_path):
    done = gpu_check(tmp_path, GPU_RUN="B", GPU_STAGES=" ".join(B_ONLY))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    records = stages(tmp_path)
    assert sorted(records) == sorted(B_ONLY)
    assert {r["status"] for r in records.values()} == {"ok"}, records
    assert "tests collected" in (tmp_path / "suites.log").read_text()
    rows = json.loads((tmp_path / "gpu_caching_adam.json").read_text())["rows"]
    assert [(r["batch_size"], r["layout"].split()[0]) for r in rows] == [
        (batch, kind) for batch in (256, 512) for kind in ("cache", "in-place", "cache")]
    assert all(r["leaked_bytes"] == {} for r in rows)
    grid = json.loads((tmp_path / "hash_table_grid_1M.json").read_text())["rows"]
    assert sorted((r["load"], r["dim"]) for r in grid) == sorted(
        (load, dim) for load in (0.5, 0.75, 1.0) for dim in (8, 64, 128))
    assert "train steps, batch 256: by host time" in (tmp_path / "profile.log").read_text()


def test_past_the_deadline_every_stage_of_b_is_skipped_and_recorded(tmp_path):
    done = gpu_check(tmp_path, GPU_RUN="B", GPU_DEADLINE_S="0", timeout=120)
    assert done.returncode == 1
    records = stages(tmp_path)
    assert sorted(records) == sorted(RUN_B)
    assert {r["status"] for r in records.values()} == {"skipped"}
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    names = [line.split()[0] for line in summary[:-1]]
    assert [n for n in names if n != "build"] == RUN_B[1:]  # the build's is written beside
    assert summary[-1].startswith(f"gpu-check run B: {len(RUN_B)} stages, {len(RUN_B)} not ok")


def test_a_stage_past_its_timeout_is_stopped_and_recorded(tmp_path):
    done = gpu_check(tmp_path, GPU_STAGES="steps", GPU_STAGE_LIMIT_S="1", timeout=120)
    assert done.returncode == 1
    (record,) = stages(tmp_path).values()
    assert (record["stage"], record["status"], record["rc"], record["timeout"]) == (
        "steps", "timeout", 124, 1)
    assert record["seconds"] < 15
    assert "steps status=timeout rc=124" in (tmp_path / "summary.txt").read_text()
    assert "== steps (estimate 70s, timeout 1s" in (tmp_path / "steps.log").read_text()


@pytest.fixture
def benchmark_scripts(monkeypatch):
    """The benchmark folder importable, as when its scripts run."""
    monkeypatch.syspath_prepend(BENCHMARK)
    import _accelerator  # noqa: PLC0415

    return _accelerator


def _step_check(monkeypatch, tmp_path, *args) -> int:
    import gpu_step_check  # noqa: PLC0415

    monkeypatch.setattr(sys, "argv", ["gpu_step_check.py", "--emulated", "--lookups", "128",
                                      "--num-ids", "64", "--dim", "4", "--replays", "2",
                                      "--layouts", "cache", "--optimizers", "sgd",
                                      "--out", str(tmp_path / "steps"), *args])
    return gpu_step_check.main()


def test_a_wrong_replay_fails_the_step_check(monkeypatch, tmp_path, benchmark_scripts):
    """With the eager twin one step behind the graph, the check finds every difference
    and exits 1 (it passes otherwise: the dry run)."""
    monkeypatch.setattr(benchmark_scripts.EmulatedAccelerator, "capture_runs_step", False)
    assert _step_check(monkeypatch, tmp_path, "--parts", "graph") == 1
    (record,) = jsonl(tmp_path / "steps.jsonl")
    assert not record["ok"] and record["max_abs_diff"]["output"] > 0
    assert "clocks differ" in record["failures"]


def test_a_sync_in_the_step_fails_the_step_check(monkeypatch, tmp_path, benchmark_scripts):
    from dynamicemb import BatchedDynamicEmbeddingTables  # noqa: PLC0415

    forward = BatchedDynamicEmbeddingTables.forward

    def reading_forward(self, indices, *args, **kwargs):
        int(indices.sum())  # a read of device data on the host
        return forward(self, indices, *args, **kwargs)

    monkeypatch.setattr(BatchedDynamicEmbeddingTables, "forward", reading_forward)
    assert _step_check(monkeypatch, tmp_path, "--parts", "syncs") == 1
    (record,) = jsonl(tmp_path / "steps.jsonl")
    assert record["syncs"]["ids_present_again"]["count"] == 1
    assert record["error_mode"].startswith("syncs: 1 x Tensor.__int__")
    assert any(f.startswith("a warm step synced") for f in record["failures"])


def test_a_layout_kept_alive_into_the_next_is_a_leak(monkeypatch, tmp_path, benchmark_scripts):
    """The tables benchmark's leak check sees a layout that outlives its row (the bug
    that put two 64M tables on one GPU) and exits 1."""
    import benchmark_gpu_tables  # noqa: PLC0415

    kept = []
    build = benchmark_gpu_tables.Dynamic.__init__

    def kept_alive(self, *args, **kwargs):
        build(self, *args, **kwargs)
        kept[:] = [self]  # the last layout, as a variable still bound would

    monkeypatch.setattr(benchmark_gpu_tables.Dynamic, "__init__", kept_alive)
    monkeypatch.setattr(sys, "argv", [
        "benchmark_gpu_tables.py", "--emulated", "--batch_sizes", "64", "--num_embeddings",
        "1024", "--optimizers", "sgd", "--embedding_dim", "8", "--num_iterations", "1",
        "--warmup", "0", "--distinct_batches", "1", "--layouts", "all-hbm", "all-hbm-graphed",
        "--leak_slack_mib", "0.01", "--out", str(tmp_path / "tables")])
    assert benchmark_gpu_tables.main() == 1
    rows = jsonl(tmp_path / "tables.jsonl")
    assert len(rows) == 2
    # a table of 1,024 rows of 8 floats: more than 32 KiB held after each row
    assert all(r["leaked_bytes"]["tensors"] > 1024 * 8 * 4 for r in rows)


def test_the_profiler_count_takes_waits_in_the_step_and_device_to_host_copies(
        benchmark_scripts):
    def event(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [event("cudaStreamSynchronize", 1, 2),  # before the step: not counted
              event("gpu_check_step", 10, 50),
              event("cudaLaunchKernel", 11, 12),
              event("cudaEventSynchronize", 20, 23),
              event("cuStreamSynchronize", 30, 31),  # CuPy's
              event("Memcpy DtoH (Device -> Pinned)", 40, 41),
              event("Memcpy DtoH (Device -> Pageable)", 45, 46),
              event("cudaDeviceSynchronize", 60, 70)]  # the profiler's own, after the step
    counted = benchmark_scripts.count_waiting_events(events)
    assert counted == {"waits": {"cudaEventSynchronize": 1, "cuStreamSynchronize": 1},
                       "wait_us": {"cudaEventSynchronize": 3, "cuStreamSynchronize": 1},
                       "device_to_host": {"Memcpy DtoH (Device -> Pinned)": 1,
                                          "Memcpy DtoH (Device -> Pageable)": 1},
                       "window_found": True}
    assert not benchmark_scripts.count_waiting_events(events[:1])["window_found"]
