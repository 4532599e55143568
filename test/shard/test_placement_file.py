"""Placement files (``DynamicEmbTableOptions.placement``) and the graph partition that
writes them (``dynamicemb.partition``): the partition's cut on small graphs with a
known best cut, the file format and its refusals, and, on 2 gloo ranks, ids on the
rank the file names (others on their hash owner), training equal to unsharded tables,
and checkpoints that reshard (to hash placement, back, and to one rank)."""

import numpy as np
import pytest
import torch

from dynamicemb import DynamicEmbLoad, DynamicEmbPoolingMode, DynamicEmbTableOptions
from dynamicemb.partition import PartitionConfig, partition_ids, route_samples
from dynamicemb.placement import owner_rank, table_placement, write_placement
from dynamicemb_testing import adam_workers, placement_workers
from dynamicemb_testing.dist_utils import SharedSpawns
from dynamicemb_testing.placement_reference import owner

WORLD = 2


def _two_clusters(bridge: bool) -> np.ndarray:
    """Samples 0-9 use ids 1, 2, 3 and samples 10-19 ids 11, 12, 13 (one id per
    feature); with ``bridge`` sample 0 uses 13 in place of 3 (the one edge to cut)."""
    sparse = np.array([[1, 2, 3]] * 10 + [[11, 12, 13]] * 10, np.int64)
    if bridge:
        sparse[0, 2] = 13
    return sparse


def test_partition_cuts_the_one_bridge_edge_of_two_clusters():
    result = partition_ids(_two_clusters(True), ["a", "b", "c"], PartitionConfig(world_size=2))
    edges = 60
    assert result.stats["edges"] == edges
    assert result.stats["local_fraction"] == pytest.approx((edges - 1) / edges)  # the best cut
    samples = result.sample_ranks
    assert len(set(samples[:10])) == 1 and len(set(samples[10:])) == 1 and samples[0] != samples[10]
    for name, first, second in (("a", 1, 11), ("b", 2, 12), ("c", 3, 13)):
        ids, ranks = result.placements[name]
        placed = dict(zip(ids.tolist(), ranks.tolist()))
        assert placed.get(first, samples[0]) == samples[0] and placed[second] == samples[10], name
    assert result.stats["ids_per_rank"] == [3, 3]  # each cluster's ids with its samples


def test_hierarchical_partition_keeps_linked_clusters_on_one_node():
    # four clusters of 10 samples; clusters 0-1 and 2-3 share a hot id (id 100 / 200)
    rows = []
    for c in range(4):
        shared = 100 if c < 2 else 200
        rows += [[10 * c + 1, 10 * c + 2, shared]] * 10
    result = partition_ids(np.array(rows, np.int64), ["a", "b", "c"],
                           PartitionConfig(world_size=4, ranks_per_node=2))
    node = result.sample_ranks // 2
    clusters = [set(result.sample_ranks[10 * c:10 * c + 10].tolist()) for c in range(4)]
    assert all(len(c) == 1 for c in clusters), clusters  # no cluster split
    assert len({r for c in clusters for r in c}) == 4  # one cluster per rank
    assert node[0] == node[10] and node[20] == node[30] and node[0] != node[20]
    assert result.stats["cost"] < result.stats["hash_cost"]


def test_min_count_and_max_ids_choose_the_placed_ids():
    sparse = _two_clusters(False)
    sparse[5, 0] = 99  # seen once: stays on its hash owner
    result = partition_ids(sparse, ["a", "b", "c"], PartitionConfig(world_size=2))
    assert 99 not in result.placements["a"][0].tolist()
    hottest = partition_ids(sparse, ["a", "b", "c"], PartitionConfig(world_size=2, max_ids=2))
    assert sum(len(ids) for ids, _ in hottest.placements.values()) == 2
    with pytest.raises(ValueError, match="ranks_per_node"):
        PartitionConfig(world_size=4, ranks_per_node=3)


def test_replicated_ids_stay_out_of_the_partition():
    # id 7 of table "a" is in every sample: replicas will serve it, so the partition
    # leaves it out, and without it the two clusters split cleanly. A count is per
    # table, the most frequent first, ties to the smaller id (as refresh_replicas)
    sparse = _two_clusters(False)
    sparse[:, 0] = 7
    both = ["a", "b", "c"]
    placed = partition_ids(sparse, both, PartitionConfig(world_size=2)).placements
    assert 7 in placed["a"][0].tolist()
    result = partition_ids(sparse, both, PartitionConfig(world_size=2, replicas=1))
    assert result.placements["a"][0].tolist() == []  # table a's one id, replicated
    assert [result.placements[t][0].tolist() for t in "bc"] == [[12], [13]]  # 2 and 3 tie, replicated
    assert result.stats["local_fraction"] == 1.0 and result.stats["replicas"] == 1
    # a fraction of each table's ids, rounded: 0.6 of 1 id and of 2 ids is 1 id each
    most = partition_ids(sparse, both, PartitionConfig(world_size=2, replicas=0.6)).placements
    assert [len(most[t][0]) for t in both] == [0, 1, 1]
    capped = partition_ids(sparse, both, PartitionConfig(world_size=2, replicas=0.6, max_ids=1))
    assert sum(len(ids) for ids, _ in capped.placements.values()) == 1  # max_ids among the others
    assert 7 not in capped.placements["a"][0].tolist()
    for bad in (-0.5, 1.5):
        with pytest.raises(ValueError, match="replicas must be"):
            PartitionConfig(world_size=2, replicas=bad)


def test_route_samples_balances_and_follows_the_owners():
    owners = torch.tensor([[0, 0], [0, 0], [0, 1], [1, 1], [0, 0], [1, 1]])
    split = route_samples(owners, 2)
    assert [t.tolist() for t in split] == [[0, 1, 4], [2, 3, 5]]  # 2 is the tie that fills rank 1
    with pytest.raises(ValueError, match="do not split evenly"):
        route_samples(owners[:5], 2)


def test_route_samples_ignores_replicated_ids():
    # sample 0's one placed id is on rank 1; its replicated ids (-1) vote for no rank
    owners = torch.tensor([[1, -1, -1], [0, 0, 0], [-1, -1, -1], [1, 1, 0]])
    split = route_samples(owners, 2)
    assert [t.tolist() for t in split] == [[1, 2], [0, 3]]  # sample 2 takes the seat left


def test_file_round_trip_and_owner_rank(tmp_path):
    path = str(tmp_path / "p.npz")
    keys = torch.tensor([5, -3, 2**62, 7])
    write_placement(path, 4, {"t": (keys, torch.tensor([3, 0, 1, 2]))})
    placement = table_placement(path, "t", 4)
    probe = torch.tensor([7, 8, -3, 2**62, 5, -(2**63)])
    hashed = owner_rank(probe, 4)
    got = owner_rank(probe, 4, "hash", placement)
    assert got.tolist() == [2, int(hashed[1]), 0, 1, 3, int(hashed[5])]
    assert table_placement(path, "t", 1) is None  # one shard: nothing to place
    assert DynamicEmbTableOptions(dim=4, placement=tmp_path / "p.npz").placement == path
    assert placement.replicated.tolist() == []  # none given


def test_file_carries_the_partition_s_replicated_ids(tmp_path):
    sparse = _two_clusters(False)
    sparse[:, 0] = 7
    result = partition_ids(sparse, ["a", "b", "c"], PartitionConfig(world_size=2, replicas=0.6))
    assert {t: r.tolist() for t, r in result.replicated.items()} == {"a": [7], "b": [2], "c": [3]}
    path = str(tmp_path / "r.npz")
    write_placement(path, 2, result.placements, result.replicated)
    for name in "abc":
        placement = table_placement(path, name, 2)
        assert placement.replicated.tolist() == result.replicated[name].tolist()
        assert not bool(torch.isin(placement.replicated, placement.ids).any())  # not placed
    write_placement(path, 2, {"a": ([1], [0])}, {"a": torch.tensor([9, -4, 3])})  # any order
    assert table_placement(path, "a", 2).replicated.tolist() == [-4, 3, 9]
    with pytest.raises(ValueError, match=r"replicated ids of tables \['z'\]"):
        write_placement(path, 2, {"a": ([1], [0])}, {"z": torch.tensor([1])})
    with pytest.raises(ValueError, match="replicated ids are not a sorted 1-D array"):
        write_placement(path, 2, {"a": ([1], [0])}, {"a": torch.tensor([3, 3])})


def _bad(tmp_path, name, **arrays):
    path = str(tmp_path / name)
    np.savez(path, **arrays)
    return path


def test_bad_files_are_refused_by_name(tmp_path):
    good = dict(format=np.array("dynamicemb-placement"), version=np.array(1),
                world_size=np.array(2), tables=np.array(["t"]), ids_0=np.array([1, 5]),
                ranks_0=np.array([0, 1]))
    cases = {
        "missing.npz": (None, "cannot be read"),
        "garbage.npz": (b"not a zip file", "not a readable .npz"),
        "pickled.npz": ({**good, "ids_0": np.array([object()], dtype=object)}, "not a readable"),
        "other.npz": ({**good, "format": np.array("something")}, "not a dynamicemb placement"),
        "version.npz": ({**good, "version": np.array(9)}, "version 9"),
        "range.npz": ({**good, "ranks_0": np.array([0, 2])}, "outside"),
        "unsorted.npz": ({**good, "ids_0": np.array([5, 1])}, "not sorted and unique"),
        "lost.npz": ({k: v for k, v in good.items() if k != "ranks_0"}, "corrupt"),
        "hot.npz": ({**good, "replicated_0": np.array([4, 4])}, "replicated ids are not a sorted"),
    }
    for name, (content, message) in cases.items():
        path = str(tmp_path / name)
        if isinstance(content, bytes):
            with open(path, "wb") as f:
                f.write(content)
        elif content is not None:
            path = _bad(tmp_path, name, **content)
        with pytest.raises(ValueError, match=message) as err:
            DynamicEmbTableOptions(dim=4, placement=path)
        assert name in str(err.value), (name, str(err.value))
    path = _bad(tmp_path, "good.npz", **good)
    with pytest.raises(ValueError, match="places ids over 2 ranks.*sharded over 4"):
        table_placement(path, "t", 4)
    with pytest.raises(ValueError, match="has no table 'u'"):
        table_placement(path, "u", 2)
    with pytest.raises(ValueError, match="outside"):
        write_placement(str(tmp_path / "w.npz"), 2, {"t": (torch.tensor([1]), torch.tensor([2]))})
    with pytest.raises(ValueError, match="path of a placement file"):
        DynamicEmbTableOptions(dim=4, placement=3)


def _placed():
    """Every other pool id of the row-wise tables on the rank its hash does not name,
    plus ids no batch uses."""
    placed = {}
    for name in placement_workers.ROW_WISE:
        pool = adam_workers._id_pool(name).tolist()
        placed[name] = {k: 1 - owner(k, WORLD, "hash") for k in pool[::2]}
        placed[name].update({10**15 + i: i % WORLD for i in range(5)})
    return placed


@pytest.fixture(scope="module")
def placed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement_file")
    path, placed = str(tmp / "placement.npz"), _placed()
    write_placement(path, WORLD, {name: (torch.tensor(list(p)), torch.tensor(list(p.values())))
                                  for name, p in placed.items()})
    spawns = SharedSpawns(str(tmp / "outcomes"))
    spawns.run(WORLD, [
        ("train-dedup", placement_workers.placement_trains_like_unsharded, (path, placed, True)),
        ("train", placement_workers.placement_trains_like_unsharded, (path, placed, False)),
        ("checkpoints", placement_workers.checkpoints_with_a_placement,
         (str(tmp / "ckpt"), path, placed, str(tmp / "rows.pt")))])
    return spawns, tmp


@pytest.mark.parametrize("case", ["train-dedup", "train"])
def test_placed_ids_land_on_their_rank_and_train_like_unsharded(placed_runs, case):
    placed_runs[0].check(case)


def test_checkpoints_with_a_placement_reshard(placed_runs):
    spawns, tmp = placed_runs
    spawns.check("checkpoints")
    want = torch.load(str(tmp / "rows.pt"), weights_only=True)
    for tables, pooling in ((adam_workers.EC_TABLES, DynamicEmbPoolingMode.NONE),
                            (adam_workers.EBC_TABLES, DynamicEmbPoolingMode.SUM)):
        one_rank = adam_workers._reference(tables, pooling, placement_workers.FUSED)
        DynamicEmbLoad(str(tmp / "ckpt"), one_rank, table_names=list(tables))
        for name in tables:
            if name not in want:
                continue
            rows = one_rank.export_keys_values(name)
            got = dict(zip(rows.keys.tolist(), torch.cat([rows.embeddings, rows.optimizer_states], 1)))
            assert got.keys() == want[name].keys(), name  # nothing lost, nothing doubled
            assert all(torch.equal(got[k], v) for k, v in want[name].items()), name
