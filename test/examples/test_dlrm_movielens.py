"""MovieLens-100K in the DLRM job (examples/dlrm/movielens.py): the recbole wheel's files
read against a plain reading of them, GroupLens' format alike, bad files named, ranks
partitioning the samples, and the job with a graph-partitioned placement on 2 ranks."""

import json
import os

import numpy as np
import pytest
import torch

from dynamicemb_testing.dlrm import load_dlrm_data, load_dlrm_movielens, torchrun
from dynamicemb_testing.scripts import run_python

ml = load_dlrm_movielens()
DataError = load_dlrm_data().DataError


def _recbole_file(name: str) -> list:
    """The wheel's ``ml-100k.<name>`` as rows of tab-separated fields, header dropped."""
    with open(os.path.join(ml.default_folder(), f"ml-100k.{name}"), encoding="latin-1") as f:
        return [line.rstrip("\n").split("\t") for line in f][1:]


def _samples(data) -> dict:
    """``{(user, item): (dense, sparse, label)}`` of every batch, asserting the shapes
    and that no pair comes twice."""
    out = {}
    for batch in data:
        assert batch.dense.dtype == torch.float32 and batch.dense.shape[1] == ml.NUM_DENSE
        assert batch.sparse.dtype == torch.int64 and batch.sparse.shape[1] == len(ml.FEATURES)
        assert batch.labels.dtype == torch.float32 and len(batch.labels) <= data.batch_size
        for d, s, y in zip(batch.dense.tolist(), batch.sparse.tolist(), batch.labels.tolist()):
            assert (s[0], s[1]) not in out
            out[s[0], s[1]] = (d, s, y)
    return out


def _batches(data) -> list:
    return [torch.cat([b.dense, b.sparse.double(), b.labels[:, None]], 1) for b in data]


def test_packaged_data_reads_every_rating():
    train, held_out = ml.MovieLens(4096), ml.MovieLens(4096, split="eval")
    samples = {**_samples(train), **_samples(held_out)}
    ratings = {(int(u), int(i)): float(r) for u, i, r, _ in _recbole_file("inter")}
    assert len(ratings) == len(samples) == train.num_samples + held_out.num_samples == 100_000
    assert 0.88 < train.num_samples / 100_000 < 0.92
    assert all(samples[pair][2] == float(r >= 4) for pair, r in ratings.items())
    assert 0.4 < np.mean([y for _, _, y in samples.values()]) < 0.7
    assert train.cardinalities[:2] == (943, 1682) == (len(_recbole_file("user")), len(_recbole_file("item")))
    assert len(train.cardinalities) == len(ml.FEATURES)
    ages = {int(u): int(a) for u, a, *_ in _recbole_file("user")}
    assert all(abs(d[0] - ages[u] / 100) < 1e-6 for (u, _), (d, _, _) in samples.items())
    for f, rows in enumerate(train.cardinalities[2:], start=2):  # side features: 0 .. rows - 1
        assert {s[f] for _, s, _ in samples.values()} == set(range(rows))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_partition_the_samples_deterministically(world_size):
    whole = ml.MovieLens(1000)
    order = [s for b in whole for s in b.sparse[:, :2].tolist()]
    for split in ("train", "eval"):
        ranks = [ml.MovieLens(1000, split=split, rank=r, world_size=world_size) for r in range(world_size)]
        every = ml.MovieLens(1000, split=split)
        mine = [[s for b in r for s in b.sparse[:, :2].tolist()] for r in ranks]
        kept = every.num_samples - every.num_samples % world_size  # one count per rank
        assert sum(map(len, mine)) == kept and len(set(map(len, mine))) == 1
        assert all(r.num_samples == kept for r in ranks)  # the split's, all ranks
        expected = [s for b in every for s in b.sparse[:, :2].tolist()][:kept]
        assert all(m == expected[r::world_size] for r, m in enumerate(mine))  # sample i on rank i % W
        assert [len(r) for r in ranks] == [-(-len(m) // 1000) for m in mine]
    again = ml.MovieLens(1000, rank=1, world_size=world_size)
    assert all(torch.equal(a, b) for a, b in zip(_batches(again), _batches(again)))  # every pass
    assert all(torch.equal(a, b) for a, b in
               zip(_batches(again), _batches(ml.MovieLens(1000, rank=1, world_size=world_size))))
    held_out = {tuple(s) for b in ml.MovieLens(1000, split="eval") for s in b.sparse[:, :2].tolist()}
    assert not held_out & {tuple(s) for s in order}
    assert sorted(order) != order  # shuffled
    other = [tuple(s) for b in ml.MovieLens(1000, seed=1) for s in b.sparse[:, :2].tolist()]
    assert set(other) != {tuple(s) for s in order}  # another seed, another split


def _write_grouplens(folder, users, items, ratings) -> None:
    """GroupLens' u.data / u.user / u.item from RecBole rows (ratings' order reversed)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "u.data"), "w") as f:
        f.writelines("\t".join(r) + "\n" for r in reversed(ratings))
    with open(os.path.join(folder, "u.user"), "w") as f:
        f.writelines("|".join(u) + "\n" for u in users)
    with open(os.path.join(folder, "u.item"), "wb") as f:
        for item, _, year, genres in items:
            flags = ["1" if g in genres.split() else "0" for g in ml.GENRES]
            date = f"01-Jan-{year}" if year.isdigit() else ""
            line = "|".join([item, f"Café {item} ({year})", date, "", "http://x"] + flags)
            f.write((line + "\r\n").encode("latin-1"))  # GroupLens' encoding, CRLF lines


def test_grouplens_files_read_as_the_same_samples(tmp_path):
    _write_grouplens(tmp_path, _recbole_file("user"), _recbole_file("item"), _recbole_file("inter"))
    for split in ("train", "eval"):
        ours = ml.MovieLens(8192, split=split, folder=str(tmp_path), rank=1, world_size=2)
        theirs = ml.MovieLens(8192, split=split, rank=1, world_size=2)
        assert ours.cardinalities == theirs.cardinalities and len(ours) == len(theirs)
        assert all(torch.equal(a, b) for a, b in zip(_batches(ours), _batches(theirs)))


_USERS = [["1", "24", "M", "technician", "85711"], ["2", "53", "F", "other", "94043"]]
_ITEMS = [["1", "Toy Story", "1995", "Animation Children's Comedy"], ["2", "GoldenEye", "1995", "Action"]]
_RATINGS = [["1", "1", "5", "881250949"], ["1", "2", "3", "881250950"], ["2", "1", "4", "881250951"],
            ["2", "2", "1", "881250952"]]


def _edit(path, line: int, text: str) -> None:
    """Replaces line ``line`` (from 1) of ``path``."""
    with open(path, encoding="latin-1") as f:
        lines = f.read().splitlines()
    lines[line - 1] = text
    with open(path, "w", encoding="latin-1") as f:
        f.write("\n".join(lines) + "\n")


# (file, line to replace or None: delete the file, new text, words the message names)
BAD = {
    "field count": ("u.data", 3, "2\t1\t4", "u.data:3"),
    "user id": ("u.data", 2, "x\t2\t3\t881250950", "u.data:2"),
    "rating": ("u.data", 4, "2\t2\tgood\t881250952", "u.data:4"),
    "unknown user": ("u.data", 1, "7\t1\t5\t881250949", "u.data:1"),
    "unknown item": ("u.data", 4, "2\t9\t1\t881250952", "u.data:4"),
    "user line": ("u.user", 2, "2|53|F|other", "u.user:2"),
    "age": ("u.user", 1, "1|old|M|technician|85711", "u.user:1"),
    "item line": ("u.item", 1, "1|Toy Story|01-Jan-1995", "u.item:1"),
    "genre flag": ("u.item", 2, "2|GoldenEye|01-Jan-1995||url|" + "|".join("2" * 19), "u.item:2"),
    "no ratings": ("u.data", 0, "", "u.data"),
    "no item file": ("u.item", None, "", "u.item"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_raise_a_data_error_naming_the_file(tmp_path, case):
    _write_grouplens(tmp_path, _USERS, _ITEMS, _RATINGS)
    assert sum(len(b.labels) for b in ml.MovieLens(2, folder=str(tmp_path))) \
        + ml.MovieLens(2, split="eval", folder=str(tmp_path)).num_samples == 4  # the good files read
    name, line, text, named = BAD[case]
    path = tmp_path / name
    if line is None:
        path.unlink()
    elif line == 0:
        path.write_text("")
    else:
        _edit(path, line, text)
    with pytest.raises(DataError, match=named.replace(".", r"\.")):
        ml.MovieLens(2, folder=str(tmp_path))


def test_bad_folders_and_recbole_headers(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        ml.MovieLens(2, folder=str(tmp_path / "absent"))
    with pytest.raises(DataError, match="neither"):
        ml.MovieLens(2, folder=str(tmp_path))
    header = "user_id:token\titem_id:token\ttimestamp:float"  # no rating column
    (tmp_path / "ml-100k.inter").write_text(header + "\n1\t1\t881250949\n")
    with pytest.raises(DataError, match=r"ml-100k\.inter:1: the header has no column rating"):
        ml.MovieLens(2, folder=str(tmp_path))


def test_movielens_job_sends_fewer_ids_with_the_placement(tmp_path):
    """The 2-rank job (EC, user and item tables dynamic) on MovieLens, by the key hash and
    by a placement of partition.py: both train, the placement crosses ranks less."""
    placement = tmp_path / "ml2.npz"
    done = run_python(["examples/dlrm/partition.py", "--data", "movielens", "--world-size", 2,
                       "--dynamic-threshold", 900, "-o", placement], timeout=300, check=True)
    stats = json.loads(done.stdout)
    assert stats["samples"] == ml.MovieLens(1).num_samples and stats["ids_placed"] > 1000, stats
    job = ("--data", "movielens", "--dynamic-threshold", 900, "--collection", "ec",
           "--batch-size", 512, "--max-steps", 30, "--eval-every", 15)
    summaries = {}
    for name, extra in (("hash", ()), ("placed", ("--placement", placement))):
        run = torchrun(*job, "--out", tmp_path / name, *extra, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "all-to-all:" in run.stdout and "eval AUC" in run.stdout, run.stdout[-2000:]
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    for s in summaries.values():
        assert s["steps"] == 30 and s["eval_auc"] > 0.65, (s["steps"], s["eval_auc"])
        assert {t: r["max_rows"] for t, r in s["dynamic_tables"].items()} == {"t_cat_0": 943, "t_cat_1": 1682}
    sent = {n: s["history"]["alltoall_dynamic_ids_per_step"] for n, s in summaries.items()}
    assert 0 < sent["placed"] < 0.7 * sent["hash"], f"dynamic ids per step: {sent}"
