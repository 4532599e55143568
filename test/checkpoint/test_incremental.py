"""incremental_dump returns exactly the rows touched since the threshold."""

import pytest
import torch

from dynamicemb_testing.checkpoint_testing import DTYPES, batch, bits, make_tables, train
from dynamicemb import DynamicEmbScoreStrategy, incremental_dump


def _touched(steps, table):
    """Keys of ``table`` the batches of ``steps`` looked up (table a: features 0, 1)."""
    keys = set()
    for s in steps:
        indices, offsets = batch(s)
        b = (offsets.numel() - 1) // 3
        lo, hi = (0, 2 * b) if table == "a" else (2 * b, 3 * b)
        keys |= set(indices[offsets[lo]:offsets[hi]].tolist())
    return keys


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.STEP,
                                      DynamicEmbScoreStrategy.LRU_LFU])
def test_rows_touched_since_the_threshold(strategy, caching, dtype):
    """The rows come as stored: in the table's dtype, bit for bit."""
    module = make_tables(strategy=strategy, caching=caching, admission=False, dtype=dtype)
    train(module, range(4))
    everything, threshold = incremental_dump(module, 0)
    assert set(everything["a"][0].tolist()) == _touched(range(4), "a")
    train(module, range(4, 6))
    fresh, threshold = incremental_dump(module, threshold)
    for table in ("a", "b"):
        keys, rows = fresh[table]
        assert set(keys.tolist()) == _touched(range(4, 6), table)
        stored = module.export_keys_values(table)
        expected = dict(zip(stored.keys.tolist(), stored.embeddings))
        assert rows.dtype == dtype
        for k, row in zip(keys.tolist(), rows):
            assert torch.equal(bits(row), bits(expected[k]))
    nothing, _ = incremental_dump(module, threshold)
    assert nothing["a"][0].numel() == 0


def test_lfu_scores_are_refused():
    module = make_tables(strategy=DynamicEmbScoreStrategy.LFU)
    with pytest.raises(Exception, match="LRU, LRU_LFU, STEP or CUSTOMIZED"):
        incremental_dump(module, 0)
