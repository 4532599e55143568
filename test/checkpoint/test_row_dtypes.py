"""Checkpoints carry a table's embedding dtype (float32, float16, bfloat16): the manifest,
the embeddings files, the state dict and the DCP records record it; a load into a table
of another dtype is refused naming both, unless asked to convert (round to nearest);
checkpoints written before 16-bit rows read as float32. Round trips per dtype through
every path are in ``test_roundtrip.py``, ``test_state_dict.py``, ``test_incremental.py``
and ``test_dmp_state_dict.py``."""

import json
import os

import numpy as np
import pytest
import torch

from dynamicemb import (CheckpointError, DynamicEmbDump, DynamicEmbLoad, DynamicEmbOptimType,
                        convert_row_dtypes)
from dynamicemb.checkpoint import Manifest, current_version
from dynamicemb.checkpoint.records import HEADER, RecordLayout, TableLoad, export_records
from dynamicemb.inference import read_rows
from dynamicemb_testing.checkpoint_testing import (DTYPES, assert_same, bits, make_tables,
                                                  snapshot, through_bytes, train)
from dynamicemb_testing.rounding_reference import narrow_rn

NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: (saved, loading) dtypes: widening, narrowing, and 16 bits to the other 16 bits
PAIRS = [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
         (torch.float16, torch.bfloat16)]
OPTIMIZER = DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD


def _pair_id(pair):
    return f"{NAMES[pair[0]]}-to-{NAMES[pair[1]]}"


def _trained(dtype, steps=range(5)):
    module = make_tables(OPTIMIZER, dtype=dtype)
    train(module, steps)
    return module


def _dumped(tmp_path, dtype):
    module = _trained(dtype)
    DynamicEmbDump(str(tmp_path / "ck"), module)
    return str(tmp_path / "ck"), module


def _manifest_path(path):
    return os.path.join(current_version(path), "manifest.json")


def _rounded(embeddings, dtype):
    """What a table of ``dtype`` stores for ``embeddings``: round to nearest (even)."""
    return embeddings.float() if dtype == torch.float32 else narrow_rn(embeddings, dtype)


def _assert_converted(got, saved, dtype):
    """``got``'s rows are ``saved``'s rounded to nearest into ``dtype``; states, scores,
    counters and clocks unchanged."""
    assert got["train_steps"] == saved["train_steps"]
    for name in ("a", "b"):
        keys, embeddings, states, scores = got[name]["rows"]
        k0, e0, s0, c0 = saved[name]["rows"]
        assert embeddings.dtype == dtype and keys.numel() > 0
        assert torch.equal(bits(embeddings), bits(_rounded(e0, dtype))), name
        for x, y in [(keys, k0), (states, s0), (scores, c0)] + list(
                zip(got[name]["counters"], saved[name]["counters"])):
            assert torch.equal(bits(x), bits(y)), name
        assert got[name]["clocks"] == saved[name]["clocks"], name


# ------------------------------------------------------------ DynamicEmbDump / Load
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_manifest_and_files_carry_the_dtype(tmp_path, dtype):
    """The manifest names the dtype; the embeddings file holds the stored rows' bytes,
    bfloat16 as "<u2" bits that numpy alone widens exactly."""
    path, module = _dumped(tmp_path, dtype)
    entry = Manifest.read(_manifest_path(path)).tables["a"]
    assert entry.embedding_dtype == NAMES[dtype]
    files = entry.shards[0].files["embeddings"]
    assert files.dtype == {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<u2"}[dtype]
    data = np.fromfile(os.path.join(current_version(path), files.file), dtype=files.dtype)
    assert files.bytes == entry.rows * 8 * dtype.itemsize == data.nbytes
    if dtype == torch.bfloat16:
        data = (data.astype("<u4") << 16).view("<f4")
    saved = module.export_keys_values("a")
    assert torch.equal(torch.from_numpy(data.astype("<f4")).reshape(-1, 8),
                       saved.embeddings.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_serving_reads_the_rows_widened_exactly(tmp_path, dtype):
    path, module = _dumped(tmp_path, dtype)
    keys, embeddings = read_rows(path, ["a"])[0]["a"]
    saved = module.export_keys_values("a")
    order, ref = keys.argsort(), saved.keys.argsort()
    assert embeddings.dtype == torch.float32
    assert torch.equal(embeddings[order], saved.embeddings[ref].float())


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_another_dtype_is_refused_naming_both_and_nothing_changes(tmp_path, pair):
    path, _ = _dumped(tmp_path, pair[0])
    target = _trained(pair[1], range(40, 42))
    before = snapshot(target)
    with pytest.raises(CheckpointError) as err:
        DynamicEmbLoad(path, target)
    message = str(err.value)
    assert f"embedding dtype {NAMES[pair[0]]} saved, {NAMES[pair[1]]} in the model" in message
    assert "convert_dtype=True" in message
    assert_same(snapshot(target), before)


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_convert_dtype_rounds_to_nearest(tmp_path, pair):
    path, saved = _dumped(tmp_path, pair[0])
    target = _trained(pair[1], range(40, 42))
    DynamicEmbLoad(path, target, convert_dtype=True)
    _assert_converted(snapshot(target), snapshot(saved), pair[1])


def test_a_manifest_without_the_dtype_reads_as_float32(tmp_path):
    """A float32 table's manifest is what versions before 16-bit rows wrote (no
    ``embedding_dtype``): it loads into float32 tables exactly and is refused by
    bfloat16 ones."""
    path, saved = _dumped(tmp_path, torch.float32)
    manifest = json.load(open(_manifest_path(path)))
    assert all("embedding_dtype" not in table for table in manifest["tables"].values())
    loaded = make_tables(OPTIMIZER)
    DynamicEmbLoad(path, loaded)
    assert_same(snapshot(loaded), snapshot(saved))
    with pytest.raises(CheckpointError, match="embedding dtype float32 saved, bfloat16"):
        DynamicEmbLoad(path, make_tables(OPTIMIZER, dtype=torch.bfloat16))


@pytest.mark.parametrize("change, message", [
    ({"embedding_dtype": "int8"}, "embedding_dtype 'int8'"),
    ({"embedding_dtype": "float32"}, "embeddings file of dtype '<u2'"),
], ids=["unknown", "files-disagree"])
def test_a_manifest_whose_dtype_is_wrong_is_refused(tmp_path, change, message):
    path, _ = _dumped(tmp_path, torch.bfloat16)
    manifest = json.load(open(_manifest_path(path)))
    manifest["tables"]["a"].update(change)
    json.dump(manifest, open(_manifest_path(path), "w"))
    target = make_tables(OPTIMIZER)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=message):
        DynamicEmbLoad(path, target, convert_dtype=True)
    assert_same(snapshot(target), before)


# ---------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_state_dict_of_another_dtype_is_refused_or_converted(pair):
    saved = _trained(pair[0])
    state = through_bytes(saved.state_dict())
    table = state["_extra_state"]["tables"]["a"]
    assert table["embedding_dtype"] == NAMES[pair[0]] and table["embeddings"].dtype == pair[0]
    target = _trained(pair[1], range(40, 42))
    before = snapshot(target)
    with pytest.raises(ValueError) as err:
        target.load_state_dict(state)
    message = str(err.value)
    assert f"embedding_dtype '{NAMES[pair[0]]}' saved, '{NAMES[pair[1]]}' in the module" in message
    assert "convert_row_dtypes" in message
    assert_same(snapshot(target), before)
    converted = convert_row_dtypes(state, target)
    assert state["_extra_state"]["tables"]["a"]["embeddings"].dtype == pair[0]  # unchanged
    target.load_state_dict(converted)
    _assert_converted(snapshot(target), snapshot(saved), pair[1])


def test_a_state_without_the_dtype_reads_as_float32():
    saved = _trained(torch.float32)
    state = through_bytes(saved.state_dict())
    for table in state["_extra_state"]["tables"].values():
        del table["embedding_dtype"]
    loaded = make_tables(OPTIMIZER)
    loaded.load_state_dict(state)
    assert_same(snapshot(loaded), snapshot(saved))
    with pytest.raises(ValueError, match="embedding_dtype 'float32' saved, 'bfloat16'"):
        make_tables(OPTIMIZER, dtype=torch.bfloat16).load_state_dict(state)


# ------------------------------------------------------------------- DCP records
def _records_load(module, records, chunks=1):
    """``records`` through a TableLoad as ``chunks`` chunks, the header's chunk last."""
    load = TableLoad(module, "a", RecordLayout.of(module, "a"),
                     lambda keys: torch.ones(keys.shape, dtype=torch.bool))
    for chunk in reversed(torch.tensor_split(records, chunks)):
        load.add_records(chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_chunks_before_the_header_wait_for_it(dtype):
    """DCP may hand a rank's chunks in any order: those before the header chunk change
    nothing until the header has passed, so bfloat16 records (float16's width) refused
    by a float16 table leave it whole; accepted, every chunk lands."""
    saved = _trained(torch.bfloat16)
    records = export_records(saved, "a", RecordLayout.of(saved, "a"))
    assert records.shape[0] > 3
    target = _trained(dtype, range(40, 42))
    before = snapshot(target)
    with pytest.raises(ValueError, match=f"this table('s)? ha.*{NAMES[dtype]} embeddings"):
        _records_load(target, records, chunks=3)
    assert_same(snapshot(target), before)
    loaded = make_tables(OPTIMIZER, dtype=torch.bfloat16)
    train(loaded, range(40, 42))
    _records_load(loaded, records, chunks=3)
    got, want = snapshot(loaded), snapshot(saved)
    assert got["a"]["clocks"] == want["a"]["clocks"]
    for x, y in zip(got["a"]["rows"], want["a"]["rows"]):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_records_round_trip_bit_for_bit(dtype):
    """The records DCP carries: a table's rows in its dtype, clocks and train steps."""
    saved = _trained(dtype)
    records = export_records(saved, "a", RecordLayout.of(saved, "a"))
    loaded = make_tables(OPTIMIZER, dtype=dtype)
    train(loaded, range(40, 42))
    _records_load(loaded, records)
    got, want = snapshot(loaded), snapshot(saved)
    assert got["train_steps"] == want["train_steps"]
    assert got["a"]["clocks"] == want["a"]["clocks"]
    for x, y in zip(got["a"]["rows"], want["a"]["rows"]):
        assert x.dtype == y.dtype and torch.equal(bits(x), bits(y))


def test_float32_records_keep_the_layout_they_had_before_16_bit_rows():
    """A float32 header's key word is the bare dim, as every record written before the
    dtype was: such records load as float32 and are refused by a bfloat16 table."""
    saved = _trained(torch.float32)
    records = export_records(saved, "a", RecordLayout.of(saved, "a"))
    assert records[0, :3].tolist() == [HEADER, 8, 1]
    assert records.shape[1] == 3 + 4 + 1  # kind, key, score; 8 + 1 float32 columns padded
    _records_load(make_tables(OPTIMIZER), records)
    with pytest.raises(ValueError) as err:
        _records_load(make_tables(OPTIMIZER, dtype=torch.bfloat16), records)
    assert "float32 embeddings" in str(err.value) and "bfloat16 embeddings" in str(err.value)


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_records_of_another_dtype_are_refused_naming_both(pair):
    saved = _trained(pair[0])
    records = export_records(saved, "a", RecordLayout.of(saved, "a"))
    target = _trained(pair[1], range(40, 42))
    before = snapshot(target)
    with pytest.raises(ValueError) as err:
        _records_load(target, records)
    assert_same(snapshot(target), before)  # refused before the table was emptied
    message, layout = str(err.value), "dim 8 + 1 optimizer-state columns"
    assert f"saved with {layout}, {NAMES[pair[0]]} embeddings" in message
    assert f"this table has {layout}, {NAMES[pair[1]]} embeddings" in message
