"""Bad arguments raise the documented error, say what is wrong, and change nothing."""

import pytest
import torch

from dynamicemb_testing.table_testing import as_keys, make_table, state_of

BC = 16


def filled_table(device, strategy="LRU", value_dim=2, **kw):
    """A table past its load factor with room to grow: a bad call must not even grow it."""
    kw = dict(capacity=2 * BC, bucket_capacity=BC, max_capacity=8 * BC, max_load_factor=0.5, **kw)
    t = make_table(score_strategy=strategy, value_dim=value_dim, num_tables=2, device=device, **kw)
    n = 20
    scores = (torch.arange(1, n + 1, dtype=torch.int64, device=device)
              if strategy in ("CUSTOMIZED", "LFU") else None)
    values = torch.arange(n * value_dim, dtype=torch.float32, device=device).reshape(n, value_dim)
    t.insert_or_assign(as_keys(range(n), device), values, torch.arange(n, device=device) % 2,
                       scores=scores)
    assert t.capacity() == 2 * BC and t.size() > t.capacity() // 2
    return t


def full_state(t) -> dict:
    state = state_of(t)
    state["values"] = t.values.clone()
    return state


def assert_unchanged(t, before):
    after = full_state(t)
    assert torch.equal(after.pop("values"), before.pop("values"))
    assert after == before


# ---------------------------------------------------------------------- constructor
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(capacity=0), "capacity"),
        (dict(capacity=-5), "capacity"),
        (dict(bucket_capacity=0), "bucket_capacity"),
        (dict(bucket_capacity=8), "bucket_capacity"),
        (dict(bucket_capacity=24), "bucket_capacity"),
        (dict(bucket_capacity=-16), "bucket_capacity"),
        (dict(capacity=1024, max_capacity=512), "max_capacity"),
        (dict(max_load_factor=0.0), "max_load_factor"),
        (dict(max_load_factor=-0.5), "max_load_factor"),
        (dict(max_load_factor=1.01), "max_load_factor"),
        (dict(num_tables=0), "num_tables"),
        (dict(num_tables=32768), "num_tables"),
        (dict(value_dim=-1), "value_dim"),
    ],
)
def test_constructor_rejects(kw, match, device):
    args = dict(capacity=256, bucket_capacity=16)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        make_table(device=device, **args)


@pytest.mark.parametrize("kw", [dict(num_tables=32767), dict(max_load_factor=1.0), dict(value_dim=0)])
def test_constructor_accepts_limits(kw, device):
    make_table(capacity=16, bucket_capacity=16, device=device, **kw)


# ---------------------------------------------------------------------- verbs
def good_args(t, verb, n=4, dim=2, strategy="LRU"):
    """Valid arguments of ``verb``, on the table's device."""
    device = t.device
    args = {"keys": as_keys(range(100, 100 + n), device),
            "table_ids": torch.ones(n, dtype=torch.int64, device=device)}
    if verb in ("insert_or_assign", "insert_and_evict"):
        args["values"] = torch.ones(n, dim, device=device)
    if verb in ("find_or_insert", "insert_or_assign", "insert_and_evict") and strategy == "CUSTOMIZED":
        args["scores"] = torch.full((n,), 3, dtype=torch.int64, device=device)
    return args


def on_device(change: dict, device) -> dict:
    """``change`` with its tensors moved to ``device`` (dtype and shape kept), so that
    each bad call is wrong only in the way its case says."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in change.items()}


ALL_VERBS = ["find", "find_or_insert", "insert_or_assign", "insert_and_evict", "erase"]
INSERTING = ["find_or_insert", "insert_or_assign", "insert_and_evict"]
WITH_VALUES = ["insert_or_assign", "insert_and_evict"]

# (verbs, change to the good arguments, error, message keyword)
BAD_CALLS = [
    (ALL_VERBS, dict(keys=torch.arange(100, 104, dtype=torch.int32)), TypeError, "keys|int64"),
    (ALL_VERBS, dict(keys=torch.arange(100.0, 104.0)), TypeError, "keys|int64"),
    (ALL_VERBS, dict(keys=torch.arange(100, 104).reshape(2, 2)), ValueError, "keys|1-D|dim"),
    (ALL_VERBS, dict(table_ids=torch.ones(4)), TypeError, "table_ids|int"),
    (ALL_VERBS, dict(table_ids=torch.ones(3, dtype=torch.int64)), ValueError, "table_ids|length"),
    (ALL_VERBS, dict(table_ids=torch.ones(2, 2, dtype=torch.int64)), ValueError, "table_ids|1-D|dim|length"),
    (ALL_VERBS, dict(table_ids=torch.tensor([0, 1, 2, 0])), ValueError, "table"),
    (ALL_VERBS, dict(table_ids=torch.tensor([0, -1, 1, 0])), ValueError, "table"),
    (ALL_VERBS, dict(table_ids=torch.tensor([0, 1, 2, 0], dtype=torch.int32)), ValueError, "table"),
    (WITH_VALUES, dict(values=torch.ones(4, 2, dtype=torch.float64)), TypeError, "values|dtype"),
    (WITH_VALUES, dict(values=torch.ones(4, 2, dtype=torch.int64)), TypeError, "values|dtype"),
    (WITH_VALUES, dict(values=torch.ones(4, 3)), ValueError, "values|shape"),
    (WITH_VALUES, dict(values=torch.ones(5, 2)), ValueError, "values|shape"),
    (WITH_VALUES, dict(values=torch.ones(8)), ValueError, "values|shape"),
    (INSERTING, dict(scores=torch.ones(4, dtype=torch.int64)), ValueError, "scores|CUSTOMIZED"),
]


def bad_call_cases():
    for verbs, change, error, match in BAD_CALLS:
        for verb in verbs:
            yield pytest.param(verb, change, error, match, id=f"{verb}-{'-'.join(change)}-{error.__name__}")


def assert_bad_call_changes_nothing(t, verb, change, error, match):
    """``verb`` with valid arguments except ``change`` raises ``error`` (message
    matching ``match``) and leaves the table exactly as it was."""
    before = full_state(t)
    args = good_args(t, verb)
    args.update(on_device(change, t.device))
    with pytest.raises(error, match=f"(?i){match}"):
        getattr(t, verb)(**args)
    assert_unchanged(t, before)


@pytest.mark.parametrize("verb, change, error, match", list(bad_call_cases()))
def test_bad_call_raises_and_changes_nothing(verb, change, error, match, device):
    t = filled_table(device)
    assert_bad_call_changes_nothing(t, verb, change, error, match)


@pytest.mark.parametrize("verb", INSERTING)
@pytest.mark.parametrize("strategy", ["LRU", "STEP", "NO_EVICTION"])
def test_scores_refused_by_strategies_without_them(verb, strategy, device):
    t = filled_table(device, strategy)
    before = full_state(t)
    args = good_args(t, verb)
    args["scores"] = torch.ones(4, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="(?i)scores"):
        getattr(t, verb)(**args)
    assert_unchanged(t, before)


# scores are required by CUSTOMIZED, and must be 1-D non-negative int64 of the keys' length
CUSTOMIZED_BAD = [
    (dict(scores=None), ValueError, "scores"),
    (dict(scores=torch.tensor([1, -1, 2, 3])), ValueError, "scores|negative"),
    (dict(scores=torch.ones(3, dtype=torch.int64)), ValueError, "scores|length"),
    (dict(scores=torch.ones(4, dtype=torch.int32)), TypeError, "scores|int64"),
    (dict(scores=torch.ones(4)), TypeError, "scores|int64"),
]


@pytest.mark.parametrize("verb", INSERTING)
@pytest.mark.parametrize("change, error, match", CUSTOMIZED_BAD)
def test_customized_scores_checked(verb, change, error, match, device):
    t = filled_table(device, "CUSTOMIZED")
    before = full_state(t)
    args = good_args(t, verb, strategy="CUSTOMIZED")
    args.update(on_device(change, device))
    with pytest.raises(error, match=f"(?i){match}"):
        getattr(t, verb)(**args)
    assert_unchanged(t, before)


# A deduplicating call takes CUSTOMIZED scores per table: (num_tables,) int64 >= 0
TABLE_SCORES_BAD = [
    ("CUSTOMIZED", None, "table_scores"),
    ("CUSTOMIZED", torch.tensor([1, -1]), ">= 0"),
    ("CUSTOMIZED", torch.ones(3, dtype=torch.int64), r"\(2,\) int64"),
    ("CUSTOMIZED", torch.ones(2, dtype=torch.int32), r"\(2,\) int64"),
    ("LRU", torch.ones(2, dtype=torch.int64), "only accepted with the CUSTOMIZED"),
]


@pytest.mark.parametrize("strategy, table_scores, match", TABLE_SCORES_BAD)
def test_table_scores_checked(strategy, table_scores, match, device):
    t = filled_table(device, strategy)
    before = full_state(t)
    if table_scores is not None:
        table_scores = table_scores.to(device)
    keys = as_keys([3, 50, 3], device)
    with pytest.raises(ValueError, match=match):
        t.prepare_dedup_find_or_insert(keys, torch.tensor([0, 1, 0], device=device),
                                       table_scores=table_scores)
    assert_unchanged(t, before)


# LFU takes optional occurrence counts: 1-D int64 of the keys' length, positive
LFU_BAD = [
    (dict(scores=torch.tensor([1, -1, 2, 3])), ValueError, "scores|counts|>= 1|negative"),
    (dict(scores=torch.ones(3, dtype=torch.int64)), ValueError, "scores|length|shape"),
    (dict(scores=torch.ones(4, dtype=torch.int32)), TypeError, "scores|int64"),
]


@pytest.mark.parametrize("verb", INSERTING)
@pytest.mark.parametrize("change, error, match", LFU_BAD)
def test_lfu_counts_checked(verb, change, error, match, device):
    t = filled_table(device, "LFU")
    assert_bad_call_changes_nothing(t, verb, change, error, match)


@pytest.mark.parametrize("verb", WITH_VALUES)
def test_values_none_rejected_when_value_dim_positive(verb, device):
    t = filled_table(device)
    before = full_state(t)
    args = good_args(t, verb)
    args["values"] = None
    with pytest.raises((TypeError, ValueError), match="(?i)values"):
        getattr(t, verb)(**args)
    assert_unchanged(t, before)


@pytest.mark.parametrize("verb", WITH_VALUES)
def test_values_none_allowed_when_value_dim_zero(verb, device):
    t = make_table(capacity=16, bucket_capacity=16, value_dim=0, device=device)
    res = getattr(t, verb)(as_keys([1, 2], device), None)
    assert res.inserted.tolist() == [True, True]


def test_int32_table_ids_accepted(device):
    t = make_table(capacity=32, bucket_capacity=16, num_tables=3, max_load_factor=1.0, device=device)
    tids = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    res = t.find_or_insert(as_keys([5, 5, 5], device), tids)
    assert res.inserted.tolist() == [True, True, True]
    assert torch.equal(t.find(as_keys([5, 5, 5], device), tids), res.slots)
    tid2 = torch.tensor([2], dtype=torch.int32, device=device)
    assert t.erase(as_keys([5], device), tid2).tolist() == [True]


@pytest.mark.parametrize("step", [-1, -(2**63)])
def test_negative_step_rejected(step, device):
    t = make_table(capacity=16, bucket_capacity=16, score_strategy="STEP", device=device)
    t.set_step(5)
    with pytest.raises(ValueError, match="(?i)step"):
        t.set_step(step)
    t.find_or_insert(as_keys([1], device))
    assert t.export_batch().scores.tolist() == [5]  # the step stayed 5


def test_misaligned_digests_are_refused():
    """The probes load 16 digests at a time from 16-byte boundaries."""
    from dynamicemb.ops import for_device
    from dynamicemb.ops.interface import TableMemory

    memory = for_device("cpu").new_table(num_buckets=1, max_num_buckets=1, bucket_capacity=BC,
                                         value_dim=0, value_dtype=torch.float32,
                                         device=torch.device("cpu"))
    shifted = torch.zeros(BC + 1, dtype=torch.uint8)[1:]
    meta = memory.meta[:3] + [shifted] + memory.meta[4:]
    with pytest.raises(ValueError, match="16-byte aligned"):
        TableMemory(meta, memory.values, 1, 1, BC)
    TableMemory(memory.meta, memory.values, 1, 1, BC)  # fresh arrays are aligned
