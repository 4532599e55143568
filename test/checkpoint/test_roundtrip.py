"""Dump and load of unsharded modules: exact round trips, continued training equal to
training that never stopped, merge, optim=False, mismatches, overwrite rules."""

import json
import os

import pytest
import torch

from dynamicemb_testing.checkpoint_testing import (DTYPES, OPTIMIZERS, assert_same, batch,
                                                  make_tables, snapshot, train)
from dynamicemb import (CheckpointError, DynamicEmbDump, DynamicEmbLoad, DynamicEmbOptimType,
                        DynamicEmbScoreStrategy)
from dynamicemb.checkpoint import Manifest, current_version


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("caching", [False, True], ids=["one_tier", "cache"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.value)
def test_round_trip_is_exact_and_training_resumes_identically(tmp_path, optimizer, caching, dtype):
    """Rows (in their dtype), states, scores, counters and clocks (the optimizer step
    names a 16-bit table's rounding bits) come back bit for bit."""
    saved = make_tables(optimizer, caching, dtype=dtype)
    train(saved, range(8))
    DynamicEmbDump(str(tmp_path / "ck"), saved)
    loaded = make_tables(optimizer, caching, dtype=dtype)
    train(loaded, range(100, 103))  # different contents first: the load must replace them
    DynamicEmbLoad(str(tmp_path / "ck"), loaded)
    before = snapshot(saved)
    assert_same(snapshot(loaded), before)
    assert before["a"]["rows"][0].numel() > 0 and before["b"]["counters"][0].numel() > 0
    counted = dtype != torch.float32 or optimizer == DynamicEmbOptimType.ADAM
    assert before["a"]["rows"][1].dtype == dtype
    assert before["a"]["clocks"].optimizer_step == (8 if counted else 0)
    # everything training depends on came back: 4 more steps agree bit for bit
    assert torch.equal(train(loaded, range(8, 12)), train(saved, range(8, 12)))
    assert_same(snapshot(loaded), snapshot(saved))


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.STEP, DynamicEmbScoreStrategy.LFU])
def test_scores_of_other_strategies_round_trip(tmp_path, strategy):
    saved = make_tables(strategy=strategy)
    train(saved, range(6))
    DynamicEmbDump(str(tmp_path / "ck"), saved)
    loaded = make_tables(strategy=strategy)
    DynamicEmbLoad(str(tmp_path / "ck"), loaded)
    assert_same(snapshot(loaded), snapshot(saved))
    assert torch.equal(train(loaded, range(6, 9)), train(saved, range(6, 9)))
    assert_same(snapshot(loaded), snapshot(saved))


def test_manifest_describes_the_tables(tmp_path):
    module = make_tables(DynamicEmbOptimType.ADAM)
    train(module, range(3))
    version = DynamicEmbDump(str(tmp_path / "ck"), module)
    assert version == current_version(str(tmp_path / "ck"))
    manifest = Manifest.read(os.path.join(version, "manifest.json"))
    a = manifest.tables["a"]
    assert (a.dim, a.state_dim, a.optimizer["optimizer"], a.score_strategy) == (8, 16, "adam", "lru")
    assert a.rows == module.table_size("a") and a.sharding == "unsharded"
    files = a.shards[0].files
    assert files["embeddings"].shape == [a.rows, 8]
    assert files["embeddings"].bytes == os.path.getsize(os.path.join(version, files["embeddings"].file))
    assert manifest.tables["b"].counter and not a.counter


def test_merge_keeps_rows_not_in_the_checkpoint(tmp_path):
    saved = make_tables()
    train(saved, range(3))
    DynamicEmbDump(str(tmp_path / "ck"), saved)
    target = make_tables()
    train(target, range(50, 53))
    own = target.export_keys_values("a")
    DynamicEmbLoad(str(tmp_path / "ck"), target, merge=True)
    merged = target.export_keys_values("a")
    expected = set(own.keys.tolist()) | set(saved.export_keys_values("a").keys.tolist())
    assert set(merged.keys.tolist()) == expected
    # rows of the checkpoint win where both have the key
    ref = dict(zip(saved.export_keys_values("a").keys.tolist(), saved.export_keys_values("a").embeddings))
    for k, e in zip(merged.keys.tolist(), merged.embeddings):
        if k in ref:
            assert torch.equal(e, ref[k])


def test_optim_false_loads_rows_with_fresh_states(tmp_path):
    saved = make_tables(DynamicEmbOptimType.ADAM)
    train(saved, range(4))
    DynamicEmbDump(str(tmp_path / "ck"), saved, optim=False)
    manifest = Manifest.read(os.path.join(current_version(str(tmp_path / "ck")), "manifest.json"))
    assert manifest.tables["a"].state_dim == 0
    with pytest.raises(CheckpointError, match="optim=False"):
        DynamicEmbLoad(str(tmp_path / "ck"), make_tables(DynamicEmbOptimType.ADAM))
    # even into another optimizer
    loaded = make_tables(DynamicEmbOptimType.EXACT_ADAGRAD)
    DynamicEmbLoad(str(tmp_path / "ck"), loaded, optim=False)
    rows, ref = loaded.export_keys_values("a"), saved.export_keys_values("a")
    o1, o2 = rows.keys.argsort(), ref.keys.argsort()
    assert torch.equal(rows.embeddings[o1], ref.embeddings[o2])
    assert torch.equal(rows.optimizer_states, torch.full_like(rows.optimizer_states, 0.1))
    assert loaded.table_clocks("a").optimizer_step == 0


def test_dim_and_optimizer_mismatches_say_what_differs(tmp_path):
    saved = make_tables(DynamicEmbOptimType.ADAM)
    train(saved, range(2))
    DynamicEmbDump(str(tmp_path / "ck"), saved)
    other_dim = make_tables(DynamicEmbOptimType.ADAM, dims=(16, 4))
    before = snapshot(other_dim)
    with pytest.raises(CheckpointError, match=r"table 'a': dim 8 saved, 16 in the model"):
        DynamicEmbLoad(str(tmp_path / "ck"), other_dim)
    assert_same(snapshot(other_dim), before)
    with pytest.raises(CheckpointError, match="optimizer adam saved, exact_sgd in the model"):
        DynamicEmbLoad(str(tmp_path / "ck"), make_tables(DynamicEmbOptimType.EXACT_SGD))
    with pytest.raises(CheckpointError, match="score strategy lru saved, step"):
        DynamicEmbLoad(str(tmp_path / "ck"), make_tables(strategy=DynamicEmbScoreStrategy.STEP))
    with pytest.raises(CheckpointError, match="no table"):
        DynamicEmbLoad(str(tmp_path / "ck"), make_tables(), table_names=["zzz"])


def test_table_names_select_tables(tmp_path):
    saved = make_tables()
    train(saved, range(3))
    DynamicEmbDump(str(tmp_path / "ck"), saved, table_names=["b"])
    version = current_version(str(tmp_path / "ck"))
    assert list(Manifest.read(os.path.join(version, "manifest.json")).tables) == ["b"]
    with pytest.raises(CheckpointError, match=r"no table \['a'\]"):
        DynamicEmbLoad(str(tmp_path / "ck"), make_tables())
    loaded = make_tables()
    DynamicEmbLoad(str(tmp_path / "ck"), loaded, table_names=["b"])
    assert loaded.table_size("a") == 0 and loaded.table_size("b") == saved.table_size("b")


def test_overwrite_is_refused_unless_allowed(tmp_path):
    path = str(tmp_path / "ck")
    module = make_tables()
    train(module, range(2))
    first = DynamicEmbDump(path, module)
    with pytest.raises(CheckpointError, match="allow_overwrite"):
        DynamicEmbDump(path, module)
    train(module, range(2, 4))
    second = DynamicEmbDump(path, module, allow_overwrite=True)
    assert second != first and not os.path.exists(first)
    assert sorted(os.listdir(path)) == sorted(["CURRENT", os.path.basename(second)])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        DynamicEmbDump(str(tmp_path / "other"), module, allow_overwrite=True)
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        DynamicEmbLoad(str(tmp_path / "missing"), module)


def test_chunked_dump_and_load_of_many_chunks(tmp_path, monkeypatch):
    """Chunks much smaller than the table: the files are the concatenation of chunks."""
    from dynamicemb.checkpoint import dump, load

    monkeypatch.setattr(dump, "CHUNK_BYTES", 1)  # 1024 slots per chunk
    monkeypatch.setattr(load, "CHUNK_ROWS", 37)
    module = make_tables(DynamicEmbOptimType.EXACT_ADAGRAD, capacity=8192)
    keys = torch.arange(3000, dtype=torch.int64) * 104729
    module.import_keys_values("a", keys, torch.randn(3000, 8), torch.rand(3000, 8),
                              scores=torch.arange(3000))
    DynamicEmbDump(str(tmp_path / "ck"), module)
    loaded = make_tables(DynamicEmbOptimType.EXACT_ADAGRAD, capacity=8192)
    DynamicEmbLoad(str(tmp_path / "ck"), loaded)
    assert_same(snapshot(loaded), snapshot(module))
