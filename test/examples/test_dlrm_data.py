"""The DLRM example's data layer: the synthetic generator against its own definition, and
the TSV / Parquet writers and readers against the batches they were given."""

import logging
import math
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynamicemb_testing.dlrm import load_dlrm_data

dd = load_dlrm_data()

N = 300  # samples in the small data sets


def synthetic(num_samples: int = N, batch_size: int = 64, **kw) -> dd.SyntheticCriteo:
    kw.setdefault("scale", 0.01)
    return dd.SyntheticCriteo(num_samples, batch_size, **kw)


def cat(batches) -> dd.Batch:
    """Concatenates batches into one (an empty iterable gives empty tensors)."""
    batches = list(batches)
    if not batches:
        return dd.Batch(torch.zeros(0, dd.NUM_DENSE), torch.zeros(0, dd.NUM_SPARSE, dtype=torch.int64),
                        torch.zeros(0))
    return dd.Batch(*(torch.cat(parts) for parts in zip(*batches)))


def select(batch: dd.Batch, rows) -> dd.Batch:
    return dd.Batch(*(field[rows] for field in batch))


def assert_same(actual: dd.Batch, expected: dd.Batch) -> None:
    for name, a, e in zip(dd.Batch._fields, actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(a, e), name


def as_written(batch: dd.Batch) -> dd.Batch:
    """What a reader gives back: dense values went through integer counts."""
    counts = torch.round(torch.expm1(batch.dense.double())).clamp(min=0)
    return batch._replace(dense=torch.log1p(counts).float())


def drain(reader, timeout: float = 20.0):
    """Iterates ``reader`` on a thread with a deadline: (batches, exception or None)."""
    result = {"batches": [], "error": None}

    def run():
        try:
            for batch in reader:
                result["batches"].append(batch)
        except Exception as error:  # noqa: BLE001 - handed to the test
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "reader hung"
    return result["batches"], result["error"]


def with_special_ids(batch: dd.Batch) -> dd.Batch:
    """Puts EMPTY_ID and ids at the edges of int64 (>= 2^63 as unsigned) into a batch."""
    sparse = batch.sparse.clone()
    sparse[::3, 5] = dd.EMPTY_ID
    sparse[1::7, 0] = -2  # fffffffffffffffe
    sparse[2::7, 1] = torch.iinfo(torch.int64).min  # 8000000000000000
    sparse[3::7, 2] = torch.iinfo(torch.int64).max
    sparse[4::7, 3] = 0
    return batch._replace(sparse=sparse)


# --- SyntheticCriteo ------------------------------------------------------------------------


def test_synthetic_is_reproducible_and_seeded():
    assert_same(cat(synthetic()), cat(synthetic()))
    other = cat(synthetic(seed=1))
    assert not torch.equal(other.sparse, cat(synthetic()).sparse)


@pytest.mark.parametrize("batch_size", [1, 7, 64, 1000])
def test_synthetic_does_not_depend_on_batch_size(batch_size):
    data = synthetic(batch_size=batch_size)
    batches = list(data)
    assert len(batches) == len(data) == math.ceil(N / batch_size)
    assert all(len(b.labels) == batch_size for b in batches[:-1])
    assert_same(cat(batches), cat(synthetic(batch_size=64)))


@pytest.mark.parametrize("world_size", [2, 3, 7])
def test_synthetic_ranks_are_disjoint_and_cover_all(world_size):
    everything = cat(synthetic())
    seen = set()
    for rank in range(world_size):
        data = synthetic(batch_size=16, rank=rank, world_size=world_size)
        mine = cat(data)
        assert len(data) == math.ceil(len(mine.labels) / 16)
        assert_same(mine, select(everything, slice(rank, None, world_size)))
        rows = {tuple(r) for r in mine.sparse.tolist()}
        assert not rows & seen
        seen |= rows
    assert len(seen) == len({tuple(r) for r in everything.sparse.tolist()})


def test_synthetic_shapes_and_dtypes():
    batch = next(iter(synthetic()))
    assert batch.dense.shape == (64, dd.NUM_DENSE) and batch.dense.dtype == torch.float32
    assert batch.sparse.shape == (64, dd.NUM_SPARSE) and batch.sparse.dtype == torch.int64
    assert batch.labels.shape == (64,) and batch.labels.dtype == torch.float32
    assert (batch.dense >= 0).all() and set(batch.labels.tolist()) <= {0.0, 1.0}
    assert len(dd.CRITEO_CARDINALITIES) == dd.NUM_SPARSE


def test_synthetic_ids_are_distinct_per_feature_and_rank():
    # alpha = 0 is uniform: 20k draws hit every rank k of these small tables.
    data = synthetic(20_000, 20_000, scale=0.001, alpha=0.0)
    sparse = cat(data).sparse
    assert data.cardinalities == [max(1, round(c * 0.001)) for c in dd.CRITEO_CARDINALITIES]
    for f, card in enumerate(data.cardinalities):
        assert len(set(sparse[:, f].tolist())) == card
    assert len(set(sparse.flatten().tolist())) == sum(data.cardinalities)


def test_synthetic_ids_spread_over_int64():
    sparse = cat(synthetic(2000, 2000, scale=1.0)).sparse
    assert (sparse < 0).any() and (sparse > 0).any()
    assert sparse.abs().max() > 2**62
    assert not (sparse == dd.EMPTY_ID).any()


def test_synthetic_ids_follow_a_power_law():
    sparse = cat(synthetic(20_000, 20_000, scale=1.0)).sparse
    _, counts = torch.unique(sparse[:, 0], return_counts=True)  # 203931 distinct ids
    assert counts.max() >= 100 * counts.median()
    small = torch.unique(sparse[:, 5], return_counts=True)[1]  # 4 ids
    assert small.max() > 2 * small.min()


@pytest.mark.parametrize("signal", [0.0, 1.0, 3.0])
def test_synthetic_label_rate(signal):
    data = synthetic(20_000, 20_000, signal=signal)
    batch = cat(data)
    assert abs(batch.labels.mean().item() - 0.25) < 0.05
    assert abs(data.true_probabilities(batch).mean().item() - 0.25) < 0.05


def test_synthetic_bayes_auc():
    assert synthetic(signal=1.0).bayes_auc() > 0.65
    assert abs(synthetic(signal=0.0).bayes_auc() - 0.5) < 0.02
    assert synthetic(signal=3.0).bayes_auc() > synthetic(signal=1.0).bayes_auc()


def test_true_probabilities_explain_the_labels():
    data = synthetic(20_000, 20_000)
    batch = cat(data)
    p = data.true_probabilities(batch)
    assert p.shape == (20_000,) and ((p > 0) & (p < 1)).all()
    # Calibration by decile: the empirical positive rate follows the true probability.
    order = torch.argsort(p)
    for part in order.chunk(10):
        assert abs(batch.labels[part].mean() - p[part].mean()) < 0.05
    # A missing id contributes nothing, and the probability is computed from the batch alone.
    assert torch.equal(data.true_probabilities(select(batch, slice(0, 5))), p[:5])
    empty = batch._replace(sparse=torch.full_like(batch.sparse, dd.EMPTY_ID))
    assert torch.isfinite(data.true_probabilities(empty)).all()


def test_synthetic_samples_and_start():
    data = synthetic()
    everything = cat(data)
    assert_same(data.samples(torch.tensor([5, 0, 299])), select(everything, [5, 0, 299]))
    held_out = cat(synthetic(100, start=N))
    assert_same(held_out, select(cat(synthetic(N + 100)), slice(N, None)))


def test_synthetic_validates_arguments():
    with pytest.raises(ValueError):
        dd.SyntheticCriteo(10, 0)
    with pytest.raises(ValueError):
        dd.SyntheticCriteo(10, 4, rank=2, world_size=2)
    assert len(dd.SyntheticCriteo(1, 4, rank=1, world_size=2)) == 0


def test_roc_auc_against_pair_count():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=gen).float()  # many ties
    labels = (torch.rand(200, generator=gen) < 0.4).float()
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0).float().sum() + 0.5 * (diff == 0).float().sum()) / diff.numel()
    assert dd.roc_auc(scores, labels) == pytest.approx(expected.item())
    assert math.isnan(dd.roc_auc(scores, torch.zeros(200)))


# --- TSV ------------------------------------------------------------------------------------


@pytest.fixture
def written():
    """Batches with EMPTY_ID and extreme ids, as a reader should give them back."""
    batches = [with_special_ids(b) for b in synthetic(N, 64)]
    return batches, as_written(cat(batches))


@pytest.mark.parametrize("suffix", ["tsv", "tsv.gz"])
@pytest.mark.parametrize("batch_size,prefetch", [(1, 1), (17, 2), (64, 4), (1000, 4)])
def test_tsv_round_trip(tmp_path, written, suffix, batch_size, prefetch):
    batches, expected = written
    path = str(tmp_path / f"day.{suffix}")
    dd.write_tsv(path, batches)
    reader = dd.CriteoTsvReader([path], batch_size, prefetch=prefetch)
    got, error = drain(reader)
    assert error is None
    assert all(len(b.labels) == batch_size for b in got[:-1])
    assert_same(cat(got), expected)
    assert reader.rows_read == N and reader.malformed == 0


def test_tsv_text_format(tmp_path, written):
    batches, expected = written
    path = tmp_path / "day.tsv"
    dd.write_tsv(str(path), batches[:1])
    lines = path.read_text().splitlines()
    assert len(lines) == 64
    fields = lines[0].split("\t")
    assert len(fields) == 1 + dd.NUM_DENSE + dd.NUM_SPARSE
    assert fields[0] in ("0", "1") and all(f.isdigit() for f in fields[1:14])
    assert fields[14 + 5] == ""  # EMPTY_ID of row 0, feature 5
    assert all(len(f) == 16 and f == f.lower() for f in fields[14:] if f)
    assert lines[1].split("\t")[14] == "fffffffffffffffe"
    assert lines[2].split("\t")[15] == "8000000000000000"
    assert lines[3].split("\t")[16] == "7fffffffffffffff"
    assert lines[4].split("\t")[17] == "0000000000000000"
    assert int(fields[14], 16) == expected.sparse[0, 0].item() % 2**64


@pytest.mark.parametrize("world_size", [2, 3])
def test_tsv_ranks_split_lines_across_files(tmp_path, written, world_size):
    batches, expected = written
    first, second = str(tmp_path / "a.tsv"), str(tmp_path / "b.tsv")
    dd.write_tsv(first, [select(b, slice(0, 37)) for b in batches[:1]])  # odd length
    dd.write_tsv(second, [select(batches[0], slice(37, None))] + batches[1:])
    parts = []
    for rank in range(world_size):
        reader = dd.CriteoTsvReader([first, second], 10, rank=rank, world_size=world_size)
        got, error = drain(reader)
        assert error is None
        assert_same(cat(got), select(expected, slice(rank, None, world_size)))
        parts.append(reader.rows_read)
    assert sum(parts) == N


def write_lines(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_tsv_malformed_lines_are_skipped_and_reported(tmp_path, written, caplog):
    batches, expected = written
    good = tmp_path / "good.tsv"
    dd.write_tsv(str(good), [select(batches[0], slice(0, 8))])
    lines = good.read_text().splitlines()

    def edit(line: str, index: int, value: str) -> str:
        fields = line.split("\t")
        fields[index] = value
        return "\t".join(fields)

    bad = [
        "\t".join(lines[0].split("\t")[:-1]),  # a short line
        edit(lines[0], 20, "xyz"),  # non-hex categorical
        edit(lines[0], 0, "2"),  # label 2
        edit(lines[0], 3, "1.5"),  # non-integer dense
        "",  # empty line
        edit(lines[0], 14, "ffffffffffffffff"),  # the id reserved for EMPTY_ID
        edit(lines[0], 14, "1" * 17),  # more than 64 bits
        edit(lines[0], 14, "0x12"),  # a prefix is not hex
    ]
    mixed = [lines[0], *bad[:4], lines[1], *bad[4:], *lines[2:]]
    path = write_lines(tmp_path / "mixed.tsv", mixed)
    with caplog.at_level(logging.WARNING):
        reader = dd.CriteoTsvReader([path], 3)
        got, error = drain(reader)
    assert error is None
    assert_same(cat(got), select(expected, slice(0, 8)))
    assert reader.malformed == len(bad) and reader.rows_read == 8
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 4  # three with the place, then one summary
    assert f"{path}:2 " in messages[0] and "field count" in messages[0]
    assert f"{path}:3 " in messages[1] and "non-hex" in messages[1]
    assert f"{path}:4 " in messages[2] and "label" in messages[2]
    assert f"{len(bad)} malformed" in messages[3]


def test_tsv_lenient_but_exact_fields(tmp_path):
    row = ["1"] + ["-3", ""] + ["7"] * 11 + ["68fd1e64", "ABCDEF", ""] + ["0"] * 23
    path = write_lines(tmp_path / "day.tsv", ["\t".join(row)])
    got, error = drain(dd.CriteoTsvReader([path], 4))
    assert error is None
    batch = cat(got)
    assert batch.dense[0, :2].tolist() == [0.0, 0.0]  # negative clamped, empty is 0
    assert batch.dense[0, 2].item() == pytest.approx(math.log1p(7))
    assert batch.sparse[0, :4].tolist() == [0x68FD1E64, 0xABCDEF, dd.EMPTY_ID, 0]


def test_tsv_missing_file_is_raised_to_the_consumer(tmp_path, written):
    batches, _ = written
    path = str(tmp_path / "day.tsv")
    dd.write_tsv(path, batches)
    missing = str(tmp_path / "no_such_day.tsv")
    got, error = drain(dd.CriteoTsvReader([path, missing], 64, prefetch=1))
    assert isinstance(error, RuntimeError) and missing in str(error)
    assert sum(len(b.labels) for b in got) <= N  # what came before the error


def test_tsv_parse_error_in_thread_is_raised(tmp_path, written, monkeypatch):
    batches, _ = written
    path = str(tmp_path / "day.tsv")
    dd.write_tsv(path, batches)

    def broken(*args):
        raise ValueError("boom")

    monkeypatch.setattr(dd.CriteoTsvReader, "_parse", staticmethod(broken))
    got, error = drain(dd.CriteoTsvReader([path], 64))
    assert got == [] and isinstance(error, RuntimeError)
    assert path in str(error) and "boom" in str(error)


def test_tsv_passes_restart_and_early_exit_stops_the_thread(tmp_path, written):
    batches, expected = written
    path = str(tmp_path / "day.tsv")
    dd.write_tsv(path, batches)
    reader = dd.CriteoTsvReader([path], 16, prefetch=1)
    before = threading.active_count()
    for _ in reader:
        break
    assert reader.rows_read == 16
    assert threading.active_count() == before
    for _ in range(2):
        got, error = drain(reader)
        assert error is None and reader.rows_read == N
        assert_same(cat(got), expected)


def test_readers_validate_arguments():
    with pytest.raises(ValueError):
        dd.CriteoTsvReader(["x"], 0)
    with pytest.raises(ValueError):
        dd.CriteoParquetReader(["x"], 4, rank=3, world_size=3)


# --- Parquet --------------------------------------------------------------------------------


def test_parquet_round_trip_and_schema(tmp_path, written):
    batches, expected = written
    path = str(tmp_path / "day.parquet")
    dd.write_parquet(path, batches)
    table = pq.read_table(path)
    assert table.column_names == ["label"] + [f"i{j}" for j in range(1, 14)] + [f"c{j}" for j in range(1, 27)]
    assert table.schema.field("i1").type == pa.int64() and table.schema.field("c1").type == pa.string()
    assert table.column("c6").null_count == (expected.sparse[:, 5] == dd.EMPTY_ID).sum() > 0
    reader = dd.CriteoParquetReader([path], 50)
    got, error = drain(reader)
    assert error is None
    assert_same(cat(got), expected)
    assert reader.rows_read == N and reader.malformed == 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_parquet_ranks_split_rows_across_files(tmp_path, written, monkeypatch, world_size):
    monkeypatch.setattr(dd.CriteoParquetReader, "_READ_ROWS", 16)  # several record batches a file
    batches, expected = written
    first, second = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    dd.write_parquet(first, [select(batches[0], slice(0, 37))])
    dd.write_parquet(second, [select(batches[0], slice(37, None))] + batches[1:])
    total = 0
    for rank in range(world_size):
        reader = dd.CriteoParquetReader([first, second], 10, rank=rank, world_size=world_size)
        got, error = drain(reader)
        assert error is None
        assert_same(cat(got), select(expected, slice(rank, None, world_size)))
        total += reader.rows_read
    assert total == N


def test_parquet_nulls_and_malformed_rows(tmp_path, caplog):
    hex_a = "00000000000000ff"
    columns = {"label": pa.array([1, None, 2, 0, 0], pa.int64())}  # a null label is malformed
    columns.update({f"i{j}": pa.array([5, 5, 5, None, 5], pa.int64()) for j in range(1, 14)})
    columns.update({f"c{j}": pa.array([hex_a, hex_a, hex_a, None, hex_a]) for j in range(1, 27)})
    columns["c3"] = pa.array([hex_a, hex_a, hex_a, None, "not hex"])
    path = str(tmp_path / "day.parquet")
    pq.write_table(pa.table(columns), path)
    with caplog.at_level(logging.WARNING):
        reader = dd.CriteoParquetReader([path], 8)
        got, error = drain(reader)
    assert error is None and reader.malformed == 3 and reader.rows_read == 2
    batch = cat(got)
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.dense[1].tolist() == [0.0] * 13  # null dense is 0
    assert batch.sparse[0].tolist() == [0xFF] * 26
    assert batch.sparse[1].tolist() == [dd.EMPTY_ID] * 26  # null categorical is empty
    messages = [r.getMessage() for r in caplog.records]
    assert f"{path}:1 " in messages[0] and "label" in messages[0]
    assert f"{path}:4 " in messages[2] and "non-hex" in messages[2]


def test_parquet_float_labels(tmp_path, written):
    batches, expected = written
    path = str(tmp_path / "day.parquet")
    dd.write_parquet(path, batches[:1])
    table = pq.read_table(path)
    labels = table.column("label").to_numpy().astype(np.float64)
    labels[3] = 0.5
    pq.write_table(table.set_column(0, "label", pa.array(labels)), path)
    reader = dd.CriteoParquetReader([path], 64)
    got, error = drain(reader)
    assert error is None and reader.malformed == 1
    assert_same(cat(got), select(expected, [j for j in range(64) if j != 3]))


def test_parquet_missing_column_is_an_error(tmp_path):
    path = str(tmp_path / "day.parquet")
    pq.write_table(pa.table({"label": pa.array([0, 1])}), path)
    got, error = drain(dd.CriteoParquetReader([path], 8))
    assert got == [] and isinstance(error, RuntimeError) and path in str(error)
