"""The module and table accessors checkpoints use."""

import pytest
import torch

from dynamicemb_testing.checkpoint_testing import make_tables, train
from dynamicemb import DynamicEmbScoreStrategy, ScoredHashTable, TableClocks


@pytest.mark.parametrize("strategy", ["lru", "step", "lfu", "customized", "no_eviction"])
def test_exact_scores_are_stored_as_given(strategy):
    table = ScoredHashTable(capacity=256, value_dim=2,
                            score_strategy=DynamicEmbScoreStrategy(strategy))
    keys = torch.tensor([5, -9, 2**40])
    scores = torch.tensor([17, 0, 3])
    table.insert_or_assign(keys, torch.ones(3, 2), scores=scores, exact_scores=True)
    assert table.scores_at(table.find(keys)).tolist() == [17, 0, 3]
    table.set_clock(41)
    custom = strategy == "customized"
    table.find_or_insert(torch.tensor([77]), scores=torch.tensor([1]) if custom else None)
    assert table.clock == 42
    with pytest.raises(ValueError, match="exact_scores"):
        table.insert_or_assign(keys, torch.ones(3, 2), exact_scores=True)


def test_clear_table_leaves_the_other_tables_of_its_group():
    module = make_tables(dims=(8, 8), admission=False)  # one physical group
    train(module, range(3))
    b_before = module.export_keys_values("b")
    module.clear_table("a")
    assert module.table_size("a") == 0
    after = module.export_keys_values("b")
    assert torch.equal(after.keys.sort().values, b_before.keys.sort().values)


def test_clocks_steps_and_counters_round_trip_through_the_accessors():
    module = make_tables()
    train(module, range(3))
    clocks = module.table_clocks("b")
    assert clocks.optimizer_step == 3 and clocks.score_clock == 3 and clocks.admission_clock > 0
    other = make_tables()
    other.set_table_clocks("b", clocks)
    other.set_train_steps(module.train_steps)
    assert other.table_clocks("b") == clocks and other.train_steps == 3
    assert other.next_score("b") == 4
    counters = module.export_admission_counters("b")
    other.import_admission_counters("b", *counters)
    got = other.export_admission_counters("b")
    order, ref = got.keys.argsort(), counters.keys.argsort()
    for x, y in zip(got, counters):
        assert torch.equal(x[order], y[ref])
    with pytest.raises(ValueError):
        other.set_table_clocks("b", TableClocks(-1, 0, 0))


def test_iter_keys_values_chunks_cover_the_export():
    module = make_tables()
    train(module, range(5))
    chunks = list(module.iter_keys_values("a", 32))
    assert max(c.keys.numel() for c in chunks) <= 32
    whole = module.export_keys_values("a")
    assert torch.equal(torch.cat([c.keys for c in chunks]), whole.keys)
    assert torch.equal(torch.cat([c.embeddings for c in chunks]), whole.embeddings)
    assert module.table_size("a") == whole.keys.numel()
