"""A damaged checkpoint fails to load with an error naming the file, before any table
changes."""

import json
import os

import pytest

from dynamicemb_testing.checkpoint_testing import assert_same, make_tables, snapshot, train
from dynamicemb import CheckpointError, DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint import current_version


@pytest.fixture
def saved(tmp_path):
    module = make_tables()
    train(module, range(5))
    version = DynamicEmbDump(str(tmp_path / "ck"), module)
    return str(tmp_path / "ck"), version


def _target():
    module = make_tables()
    train(module, range(40, 43))
    return module


def _file(version, name="embeddings", table="b"):
    return os.path.join(version, f"{table}.rank00000.{name}.bin")


def _truncate(version):
    path = _file(version)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    return path, "truncated"


def _flip(version):
    path = _file(version, "optimizer_states", "a")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return path, "checksum mismatch"


def _remove(version):
    path = _file(version, "counter_scores")
    os.unlink(path)
    return path, "missing file"


def _other_version(version):
    path = os.path.join(version, "manifest.json")
    manifest = json.load(open(path))
    manifest["format_version"] = 99
    json.dump(manifest, open(path, "w"))
    return path, "format_version 99"


def _bad_pointer(version):
    path = os.path.join(os.path.dirname(version), "CURRENT")
    open(path, "w").write("../../etc\n")
    return path, "not a version directory"


@pytest.mark.parametrize("damage", [_truncate, _flip, _remove, _other_version, _bad_pointer])
def test_damage_is_a_clear_error_and_the_model_is_unchanged(saved, damage):
    path, version = saved
    damaged, message = damage(version)
    target = _target()
    before = snapshot(target)
    with pytest.raises(CheckpointError) as error:
        DynamicEmbLoad(path, target)
    assert message in str(error.value) and damaged in str(error.value)
    assert_same(snapshot(target), before)


def test_an_intact_checkpoint_loads_after_the_same_checks(saved):
    path, version = saved
    assert current_version(path) == version
    target = _target()
    DynamicEmbLoad(path, target)
    assert target.train_steps == 5
