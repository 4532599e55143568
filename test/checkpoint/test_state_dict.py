"""state_dict / load_state_dict of unsharded modules: exact round trips through
torch.save and torch.load(weights_only=True), continued training equal to training
that never stopped, and clear refusals of other modules' states."""


import pytest
import torch
from torch import nn

from dynamicemb_testing.checkpoint_testing import (DTYPES, OPTIMIZERS, assert_same, make_tables,
                                                  snapshot, through_bytes, train)
from dynamicemb import DynamicEmbOptimType, DynamicEmbScoreStrategy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("caching", [False, True], ids=["one_tier", "cache"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.value)
def test_round_trip_is_exact_and_training_resumes_identically(optimizer, caching, dtype):
    """Rows in their dtype (a bfloat16 tensor loads with weights_only=True), states,
    scores, counters and clocks (the optimizer step names 16-bit rounding bits)."""
    saved = make_tables(optimizer, caching, dtype=dtype)
    train(saved, range(8))
    state = through_bytes(saved.state_dict())
    assert state["_extra_state"]["tables"]["a"]["embeddings"].dtype == dtype
    loaded = make_tables(optimizer, caching, dtype=dtype)
    train(loaded, range(100, 103))  # other contents first: the load must replace them
    assert not loaded.load_state_dict(state).missing_keys
    before = snapshot(saved)
    assert before["a"]["rows"][0].numel() > 0 and before["b"]["counters"][0].numel() > 0
    assert_same(snapshot(loaded), before)
    assert torch.equal(train(loaded, range(8, 12)), train(saved, range(8, 12)))
    assert_same(snapshot(loaded), snapshot(saved))


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.STEP, DynamicEmbScoreStrategy.LFU])
def test_scores_of_other_strategies_round_trip(strategy):
    saved = make_tables(strategy=strategy)
    train(saved, range(6))
    loaded = make_tables(strategy=strategy)
    loaded.load_state_dict(through_bytes(saved.state_dict()))
    assert_same(snapshot(loaded), snapshot(saved))
    assert torch.equal(train(loaded, range(6, 9)), train(saved, range(6, 9)))


def test_a_parent_module_carries_the_tables():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = make_tables()
            self.dense = nn.Linear(12, 1)

    saved, loaded = Model(), Model()
    train(saved.tables, range(4))
    state = through_bytes(saved.state_dict())
    assert "tables._extra_state" in state and "dense.weight" in state
    loaded.load_state_dict(state)
    assert_same(snapshot(loaded.tables), snapshot(saved.tables))


def _refused(target, state, *words):
    before = snapshot(target)
    with pytest.raises(ValueError) as err:
        target.load_state_dict(state)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert_same(snapshot(target), before)  # nothing changed


def test_other_modules_states_are_refused_and_nothing_changes():
    saved = make_tables(DynamicEmbOptimType.ADAM)
    train(saved, range(4))
    state = saved.state_dict()
    target = make_tables(DynamicEmbOptimType.ADAM)
    train(target, range(20, 22))
    _refused(make_tables(DynamicEmbOptimType.ADAM, dims=(8, 8)), state, "'b'", "dim 4 saved, 8")
    _refused(target.__class__(target.table_options[:1], table_names=["a"], optimizer="adam"),
             {"_table_params.0": state["_table_params.0"], "_extra_state": state["_extra_state"]},
             "['a', 'b']", "['a']")
    _refused(make_tables(DynamicEmbOptimType.EXACT_SGD), state, "optimizer 'adam' saved")
    _refused(make_tables(DynamicEmbOptimType.ADAM, strategy=DynamicEmbScoreStrategy.LFU), state,
             "score_strategy 'lru' saved")
    dropped = dict(state["_extra_state"], tables=dict(state["_extra_state"]["tables"]))
    table = dict(dropped["tables"]["a"])
    table["embeddings"] = table["embeddings"][1:]  # a row lost on the way
    dropped["tables"]["a"] = table
    _refused(target, dict(state, _extra_state=dropped), "'a'", "'embeddings'")
    _refused(target, dict(state, _extra_state={"format": "other"}), "not a dynamicemb table state")
    target.load_state_dict(state)  # the right state still loads
    assert_same(snapshot(target), snapshot(saved))


def test_state_dict_holds_one_copy_of_the_rows():
    module = make_tables(dims=(64, 4), capacity=1 << 14)
    keys = torch.arange(5000, dtype=torch.int64) * 7
    module.import_keys_values("a", keys, torch.randn(5000, 64))
    tables = module.state_dict()["_extra_state"]["tables"]
    a = tables["a"]
    assert a["embeddings"].shape == (5000, 64) and a["optimizer_states"].shape == (5000, 128)
    # fields are views of nothing else: their storages hold exactly their bytes
    for field in ("keys", "embeddings", "optimizer_states", "scores"):
        t = a[field]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), field
