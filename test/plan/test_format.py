"""HugeCTR plan files: parsing every spelling, placements, validation messages, JSON output."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamicemb.plan.format import LookupPlacement, PlanFile, PlanGroup, load_plan
from dynamicemb_testing.plan_testing import EXAMPLE_ALL_DP, EXAMPLE_MIXED, example, make_group as g

DP, TW, RW = "data_parallel", "table_wise", "row_wise"


def tw(rank):
    return LookupPlacement(TW, (rank,))


# --- the documented examples and spellings ----------------------------------------------------


def test_example_all_dp():
    plan = load_plan(EXAMPLE_ALL_DP)
    assert plan.num_gpus == 2 and plan.num_groups == 1
    assert plan.groups(1) == (PlanGroup("dp", (0, 1, 2, 3, 4), shard_id=0, shard_count=1),)
    assert plan.validate(world_size=2, num_lookups=5) == {i: LookupPlacement(DP, (0, 1)) for i in range(5)}


def test_example_mixed():
    plan = load_plan(EXAMPLE_MIXED)
    expected = {0: tw(0), 1: tw(1), 2: tw(0), 3: tw(1), 4: LookupPlacement(DP, (0, 1))}
    placements = plan.validate(world_size=2, num_lookups=5)
    assert placements == expected
    assert [placements[i].group for i in range(5)] == [0, 0, 0, 0, 1]


@pytest.mark.parametrize("text", [EXAMPLE_ALL_DP, EXAMPLE_MIXED])
def test_examples_written_back_unchanged(text):
    spelling = "old" if "num_sharding" in text else "new"
    assert load_plan(text).to_obj(spelling) == example(text)


@pytest.mark.parametrize("spelling", ["new", "old"])
@pytest.mark.parametrize("shards, ranks", [((0, 1), (0, 1)), ((1, 0), (1, 0))])
def test_row_wise_in_both_spellings(spelling, shards, ranks):
    obj = [[g([0, 1], "mp", shard, 2, spelling)] for shard in shards]
    plan = load_plan(obj)
    assert plan.groups(0) == (PlanGroup("mp", (0, 1), shards[0], 2),)
    assert plan.placements() == {0: LookupPlacement(RW, ranks), 1: LookupPlacement(RW, ranks)}


def test_localized_is_mp():
    plan = load_plan([[g([0], "localized")], [g([1], "mp")]])
    assert plan.groups(0)[0].strategy == "mp"
    assert plan.placements() == {0: tw(0), 1: tw(1)}


@pytest.mark.parametrize("obj, expected", [
    ([[g([0, 1])], [g([])]], {0: tw(0), 1: tw(0)}),  # a GPU may list nothing
    ([[g([0], "mp", 0, 1)], [g([1], "mp", 0)]], {0: tw(0), 1: tw(1)}),  # shard 0 of 1 is table-wise
    ([[g([0], "mp", 0, 2)], [g([0], "mp", 1)], [g([], "mp", None, 2)]],  # holders inherit the count
     {0: LookupPlacement(RW, (0, 1))}),
    ([[g([], "dp")], [g([], "dp")]], {}),
], ids=["empty-local-list", "shard-0-of-1", "count-on-one-gpu", "empty-dp"])
def test_accepted_variants(obj, expected):
    assert load_plan(obj).placements() == expected


def test_global_list_optional_and_unknown_keys_ignored():
    obj = example(EXAMPLE_MIXED)
    for entry in obj:
        for group in entry:
            del group["global_embedding_list"]
            group["comment"] = "ignored"
    assert load_plan(obj) == load_plan(EXAMPLE_MIXED)


def test_sources(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(EXAMPLE_MIXED)
    plan = load_plan(EXAMPLE_MIXED)
    assert load_plan(path) == load_plan(str(path)) == load_plan(example(EXAMPLE_MIXED)) == plan


def test_unreadable_sources(tmp_path):
    with pytest.raises(ValueError, match=r"^plan: not valid JSON"):
        load_plan("[[{")
    path = tmp_path / "broken.json"
    path.write_text("not json")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not valid JSON"):
        load_plan(path)
    with pytest.raises(OSError):
        load_plan(tmp_path / "missing.json")


@pytest.mark.parametrize("spelling", ["new", "old"])
@pytest.mark.parametrize("text", [EXAMPLE_ALL_DP, EXAMPLE_MIXED])
def test_to_json_round_trip(text, spelling):
    plan = load_plan(text)
    assert load_plan(plan.to_json(spelling)) == plan
    assert load_plan(plan.to_json(spelling, indent=None)) == plan


def test_to_obj_shard_keys():
    plan = PlanFile(((PlanGroup("mp", (0,), 0, 2), PlanGroup("dp", (1,))),
                     (PlanGroup("mp", (0,), 1), PlanGroup("dp", (1,)))))
    new, old = plan.to_obj("new"), plan.to_obj("old")
    assert new[0][0] == {"local_embedding_list": [0], "global_embedding_list": [[0], [0]],
                         "shard_id": 0, "shards_count": 2, "table_placement_strategy": "mp"}
    assert old[1][0] == {"local_embedding_list": [0], "global_embedding_list": [[0], [0]],
                         "sharding_id": 1, "table_placement_strategy": "mp"}
    assert set(new[0][1]) == {"local_embedding_list", "global_embedding_list", "table_placement_strategy"}
    with pytest.raises(ValueError, match="unknown spelling 'newer'"):
        plan.to_obj("newer")


# --- validation: every check, with the GPU, group and lookup named ---------------------------

E = re.escape  # messages that start with a JSON path: matched literally
MIXED = example(EXAMPLE_MIXED)
NOT_INDEX = "expected a non-negative integer"

_BAD_PLANS = [
    # wrongly shaped input: the JSON path of the bad element
    ("top-level-dict", {"a": 1}, {}, r'^plan: expected a non-empty list .* got \{"a": 1\}'),
    ("top-level-empty", [], {}, r"^plan: expected a non-empty list"),
    ("gpu-not-list", [g([0])], {}, r"^plan\[0\]: expected a list of groups"),
    ("group-not-dict", [[g([0])], [3]], {}, r"^plan\[1\]\[0\]: expected a group object, got 3$"),
    ("lookup-string", [[g([0, 1, 2], "dp")], [g([0, 1, "x"], "dp")]], {},
     "^" + E(f'plan[1][0]["local_embedding_list"][2]: {NOT_INDEX}, got "x"') + "$"),
    ("lookup-negative", [[g([0, -1])]], {}, E(f'plan[0][0]["local_embedding_list"][1]: {NOT_INDEX}, got -1')),
    ("lookup-bool", [[g([True])]], {}, E(f'plan[0][0]["local_embedding_list"][0]: {NOT_INDEX}, got true')),
    ("lookup-float", [[g([2.0])]], {}, E(f'plan[0][0]["local_embedding_list"][0]: {NOT_INDEX}, got 2.0')),
    ("local-not-list", [[{"local_embedding_list": "0,1", "table_placement_strategy": "mp"}]], {},
     E('plan[0][0]["local_embedding_list"]: expected a list of lookup indices, got "0,1"')),
    ("missing-strategy", [[{"local_embedding_list": [0]}]], {},
     E('plan[0][0]: missing "table_placement_strategy" (GPU 0 group 0)')),
    ("missing-local", [[g([0])], [{"table_placement_strategy": "mp"}]], {},
     E('plan[1][0]: missing "local_embedding_list" (GPU 1 group 0)')),
    ("strategy-not-string", [[g([0], 3)]], {},
     E('plan[0][0]["table_placement_strategy"]: expected a string, got 3')),
    ("shard-id-string", [[g([0], "mp", "a", 2)]], {}, E('plan[0][0]["shard_id"]: expected an integer >= 0')),
    ("shard-count-zero", [[g([0], "mp", 0, 0, "old")]], {},
     E('plan[0][0]["num_sharding"]: expected an integer >= 1, got 0')),
    ("shard-keys-disagree", [[dict(g([0], "mp", 0, 2), sharding_id=1)]], {},
     E('plan[0][0]: "shard_id" 0 and "sharding_id" 1 disagree')),
    ("global-not-list", [[dict(g([0]), global_embedding_list=3)]], {},
     E('plan[0][0]["global_embedding_list"]: expected a list')),
    ("global-bad-entry", [[dict(g([0]), global_embedding_list=[[0, "y"]])]], {},
     E(f'plan[0][0]["global_embedding_list"][0][1]: {NOT_INDEX}, got "y"')),
    ("global-mismatch", [[dict(g([0]), global_embedding_list=[[0], [2]])], [g([1])]], {},
     E('plan[0][0]["global_embedding_list"]: GPU 0 group 0: does not match')
     + r".*expected \[\[0\], \[1\]\], got"),
    # structure
    ("unknown-strategy", [[g([0], "xx")]], {}, r"^GPU 0 group 0: unknown strategy 'xx'"),
    ("repeated-lookup", [[g([1])], [g([0, 2, 0])]], {}, r"^GPU 1 group 0: lookup 0 is listed twice$"),
    ("group-counts-differ", [[g([0]), g([1], "dp")], [g([2])]], {},
     r"^GPU 1 has 1 group\(s\) and GPU 0 has 2"),
    ("mixed-strategies", [[g([0]), g([4], "dp")], [g([1]), g([4], "localized")]], {},
     r"^GPU 1 group 1: strategy 'mp' differs from 'dp' on GPU 0"),
    ("dp-lookups-differ", [[g([4], "dp")], [g([5, 4], "dp")]], {},
     r"^GPU 1 group 0: dp lookups \[4, 5\] differ from \[4\] on GPU 0"),
    ("dp-sharded", [[g([4], "dp", 0, 2)], [g([4], "dp", 1, 2)]], {},
     r"^GPU 0 group 0: a dp group cannot be sharded"),
    ("dp-shard-id", [[g([4], "dp")], [g([4], "dp", 1)]], {}, r"^GPU 1 group 0: a dp group cannot be sharded"),
    ("own-shard-id-out-of-range", [[g([0], "mp", 0, 2)], [g([0], "mp", 2, 2)]], {},
     r"^GPU 1 group 0: shard id 2 is out of range for 2 shard"),
    # placements
    ("lookup-out-of-range", MIXED, {"num_lookups": 4},
     r"^GPU 0 group 1: lookup 4 is out of range for 4 lookups$"),
    ("lookup-placed-nowhere", MIXED, {"num_lookups": 6}, r"^lookup 5 is placed nowhere;"),
    ("lookups-placed-nowhere", [[g([0])]], {"num_lookups": 3},
     r"^lookup 1 is placed nowhere \(nor are \[2\]\)"),
    ("placed-twice-mp-and-dp", [[g([0, 4]), g([4], "dp")], [g([1]), g([4], "dp")]], {},
     r"^lookup 4 is placed twice: GPU 0 group 0 and GPU 0 group 1$"),
    ("placed-twice-two-gpus", [[g([0, 1])], [g([1])]], {},
     r"^lookup 1 is placed twice: GPU 0 group 0 and GPU 1 group 0$"),
    ("placed-twice-two-groups",
     [[g([0], "mp", 0, 2), g([0], "mp", 0, 2)], [g([0], "mp", 1, 2), g([0], "mp", 1, 2)]], {},
     r"^lookup 0 is placed twice: GPU 0 group 0 and GPU 0 group 1$"),
    ("holder-without-shard-id", [[g([0], "mp", 0, 2)], [g([0])]], {},
     r"^GPU 1 group 0: lists lookups \[0\] in a group of 2 shards but has no shard id$"),
    ("shard-id-out-of-range", [[g([0], "mp", 0, 2)], [g([0], "mp", 5)]], {},
     r"^GPU 1 group 0: shard id 5 is out of range for 2 shards$"),
    ("unsharded-shard-id", [[g([0], "mp", 1)], [g([1])]], {},
     r"^GPU 0 group 0: shard id 1 is out of range for an unsharded group"),
    ("shard-id-repeated", [[g([0], "mp", 0, 2)], [g([0], "mp", 0, 2)]], {},
     r"^GPU 1 group 0: shard id 0 is repeated \(GPU 0 holds it too\)$"),
    ("shard-missing", [[g([0], "mp", 0, 3)], [g([0], "mp", 1, 3)], [g([], "mp", 2, 3)]], {},
     r"^group 0: shard 2 of 3 is missing"),
    ("shard-lookups-differ", [[g([1, 0], "mp", 0, 2)], [g([0], "mp", 1, 2)]], {},
     r"^GPU 1 group 0: lookups \[0\] differ from \[0, 1\] on GPU 0"),
    ("shard-counts-differ", [[g([0], "mp", 0, 2)], [g([0], "mp", 1, 3)], [g([0], "mp", 2, 3)]], {},
     r"^group 0: GPU 0 has shard count 2 and GPU 1 has 3"),
    ("world-size", MIXED, {"world_size": 3}, r"^plan has 2 GPUs, the world size is 3$"),
]


@pytest.mark.parametrize("obj, kwargs, message", [case[1:] for case in _BAD_PLANS],
                         ids=[case[0] for case in _BAD_PLANS])
def test_invalid_plans(obj, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_plan(json.dumps(obj)).validate(**kwargs)


# --- the typed model ------------------------------------------------------------------------


def test_group_and_placement_checks():
    assert PlanGroup("localized", [3, 1]) == PlanGroup("mp", (3, 1))
    for bad in [dict(strategy="rw"), dict(strategy="mp", lookups=(1, 1)), dict(strategy="mp", shard_count=0),
                dict(strategy="mp", shard_id=-1), dict(strategy="mp", shard_id=1, shard_count=1)]:
        with pytest.raises(ValueError):
            PlanGroup(**bad)
    assert LookupPlacement(RW, (0, 1), group=3) == LookupPlacement(RW, (0, 1), group=0)
    assert hash(LookupPlacement(RW, [0, 1], group=3)) == hash(LookupPlacement(RW, (0, 1)))
    for kind, ranks, message in [("column_wise", (0,), "unknown placement kind"), (RW, (1, 1), "twice"),
                                 (TW, (0, 1), "exactly one rank"), (RW, (0,), "at least 2 ranks"),
                                 (DP, (), "at least one")]:
        with pytest.raises(ValueError, match=message):
            LookupPlacement(kind, ranks)
    with pytest.raises(ValueError, match="at least one GPU"):
        PlanFile(())
    with pytest.raises(ValueError, match="GPU 2 is out of range for a plan of 2 GPUs"):
        load_plan(EXAMPLE_MIXED).groups(2)


def test_from_placements_is_canonical():
    placements = {0: tw(1), 1: LookupPlacement(RW, (2, 0)), 2: LookupPlacement(DP, (0, 1, 2)), 3: tw(0),
                  4: LookupPlacement(RW, (2, 0)), 5: LookupPlacement(RW, (0, 1))}
    plan = PlanFile.from_placements(placements, 3)
    assert plan.gpus == (
        (PlanGroup("mp", (3,)), PlanGroup("dp", (2,)), PlanGroup("mp", (1, 4), 1, 2),
         PlanGroup("mp", (5,), 0, 2)),
        (PlanGroup("mp", (0,)), PlanGroup("dp", (2,)), PlanGroup("mp", ()), PlanGroup("mp", (5,), 1, 2)),
        (PlanGroup("mp", ()), PlanGroup("dp", (2,)), PlanGroup("mp", (1, 4), 0, 2), PlanGroup("mp", ())),
    )
    assert plan.validate(world_size=3, num_lookups=6) == placements
    assert PlanFile.from_placements({}, 2).gpus == ((), ())


@pytest.mark.parametrize("placements, num_gpus, message", [
    ({0: tw(2)}, 2, "lookup 0: rank 2 is out of range for 2 GPUs"),
    ({0: LookupPlacement(DP, (0,))}, 2, "lookup 0: a data-parallel placement lists every GPU"),
    ({-1: tw(0)}, 2, "lookup -1 is not a non-negative integer"),
    ({0: "table_wise"}, 2, "lookup 0: expected a LookupPlacement"),
    ({0: tw(0)}, 0, "num_gpus must be a positive integer"),
])
def test_from_placements_errors(placements, num_gpus, message):
    with pytest.raises(ValueError, match=message):
        PlanFile.from_placements(placements, num_gpus)


# --- random plans -------------------------------------------------------------------------


@st.composite
def random_placements(draw):
    """(placements, num_gpus): random lookups, each dp, table-wise or row-wise."""
    num_gpus = draw(st.integers(1, 5))
    lookups = draw(st.sets(st.integers(0, 15), max_size=10))
    kinds = [DP, TW] + ([RW] if num_gpus >= 2 else [])
    # A few rank tuples shared by the row-wise lookups, so that groups hold several.
    rank_tuple = st.integers(2, max(2, num_gpus)).flatmap(
        lambda n: st.permutations(range(num_gpus)).map(lambda ranks: tuple(ranks[:n])))
    pool = draw(st.lists(rank_tuple, min_size=1, max_size=2)) if num_gpus >= 2 else []
    placements = {}
    for lookup in sorted(lookups):
        kind = draw(st.sampled_from(kinds))
        if kind == DP:
            placements[lookup] = LookupPlacement(DP, tuple(range(num_gpus)))
        elif kind == TW:
            placements[lookup] = tw(draw(st.integers(0, num_gpus - 1)))
        else:
            placements[lookup] = LookupPlacement(RW, draw(st.sampled_from(pool)))
    return placements, num_gpus


@settings(max_examples=150, deadline=None)
@given(random_placements())
def test_random_plans_round_trip(case):
    placements, num_gpus = case
    plan = PlanFile.from_placements(placements, num_gpus)
    assert plan.placements() == placements
    for spelling in ("new", "old"):
        assert load_plan(plan.to_json(spelling)) == plan
    assert PlanFile.from_placements(plan.placements(), num_gpus) == plan
    for lookup, placement in plan.placements().items():
        assert any(lookup in plan.groups(rank)[placement.group].lookups for rank in placement.ranks)


_JUNK = st.sampled_from([-1, "x", 2.5, None, True, [], {}, 10 ** 30, 0, 1, 2, 3, "mp", "dp", "localized",
                         [[0]]])
_KEYS = ["local_embedding_list", "global_embedding_list", "table_placement_strategy",
         "shard_id", "shards_count", "sharding_id", "num_sharding", "comment"]


def _pick_group(obj, draw):
    """(gpu entry, group index) of a random group object, or None if there is none."""
    slots = [(entry, k) for entry in obj if isinstance(entry, list) for k, item in enumerate(entry)
             if isinstance(item, dict)]
    return draw(st.sampled_from(slots)) if slots else None


def _mutate(obj, draw):
    """One random change to a plan's JSON object, in place."""
    what = draw(st.sampled_from(["drop-key", "set-key", "set-lookup", "repeat-lookup", "add-lookup",
                                 "shard", "drop-group", "junk-group", "swap-groups", "drop-gpu", "add-gpu"]))
    slot = _pick_group(obj, draw)
    if what == "drop-gpu":
        del obj[draw(st.integers(0, len(obj) - 1))]
    elif what == "add-gpu":
        obj.append(json.loads(json.dumps(obj[draw(st.integers(0, len(obj) - 1))])))
    elif slot is None:
        obj[0] = draw(_JUNK)
    else:
        entry, k = slot
        item, lookups = entry[k], entry[k].get("local_embedding_list")
        if what == "drop-key" and item:
            del item[draw(st.sampled_from(sorted(item)))]
        elif what == "set-key":
            item[draw(st.sampled_from(_KEYS))] = draw(_JUNK)
        elif what == "set-lookup" and lookups:
            lookups[draw(st.integers(0, len(lookups) - 1))] = draw(st.one_of(_JUNK, st.integers(0, 16)))
        elif what == "repeat-lookup" and lookups:
            lookups.append(draw(st.sampled_from(lookups)))
        elif what == "add-lookup" and isinstance(lookups, list):
            lookups.append(draw(st.integers(0, 16)))
        elif what == "shard":
            item[draw(st.sampled_from(_KEYS[3:7]))] = draw(st.integers(-1, 4))
        elif what == "drop-group":
            del entry[k]
        elif what == "junk-group":
            entry[k] = draw(_JUNK)
        elif what == "swap-groups":
            entry.insert(0, entry.pop(k))


def _resync_global_lists(obj):
    """Rewrites every global list from the local lists, where the shape allows."""
    if not all(isinstance(entry, list) and len(entry) == len(obj[0]) for entry in obj):
        return
    for k in range(len(obj[0])):
        column = [entry[k] for entry in obj]
        if all(isinstance(item, dict) for item in column):
            lists = [item.get("local_embedding_list") for item in column]
            for item in column:
                item["global_embedding_list"] = lists


@settings(max_examples=300, deadline=None)
@given(random_placements(), st.data())
def test_mutated_plans_load_or_raise_value_error(case, data):
    placements, num_gpus = case
    obj = PlanFile.from_placements(placements, num_gpus).to_obj(data.draw(st.sampled_from(["new", "old"])))
    _mutate(obj, data.draw)
    if obj and data.draw(st.booleans()):
        _resync_global_lists(obj)
    num_lookups = data.draw(st.one_of(st.none(), st.integers(0, 16)))
    try:
        plan = load_plan(json.dumps(obj))
        plan.validate(world_size=data.draw(st.sampled_from([None, num_gpus])), num_lookups=num_lookups)
    except ValueError:
        return
    assert load_plan(plan.to_json()) == plan


@settings(max_examples=100, deadline=None)
@given(random_placements(), st.data())
def test_truncated_json_raises_value_error(case, data):
    text = PlanFile.from_placements(*case).to_json(indent=None)
    cut = data.draw(st.integers(0, len(text) - 1))
    with pytest.raises(ValueError):
        load_plan("[" + text[1:cut])
