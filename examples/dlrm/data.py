"""Criteo-shaped data for the DLRM example: a synthetic generator, writers and readers.

Every source yields :class:`Batch` es of 13 dense features, one raw 64-bit id for each of
the 26 categorical features, and a 0/1 label. Raw ids are the dynamic tables' keys, so
nothing here maps them into ``[0, num_embeddings)``.

Example::

    data = SyntheticCriteo(100_000, batch_size=512, scale=0.01)
    write_tsv("day_0.tsv", data)
    for batch in CriteoTsvReader(["day_0.tsv"], batch_size=512, rank=0, world_size=2):
        ...  # batch.dense (512, 13), batch.sparse (512, 26), batch.labels (512,)
"""

import gzip
import logging
import math
import queue
import threading
from typing import Generator, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

logger = logging.getLogger(__name__)

CRITEO_CARDINALITIES = [
    203931, 18598, 14092, 7012, 18977, 4, 6385, 1245, 49, 186213, 71328, 67288, 11,
    2168, 7338, 61, 4, 932, 15, 204515, 141526, 199433, 60919, 9137, 71, 34,
]
NUM_DENSE = 13
NUM_SPARSE = 26
EMPTY_ID = -1  # an empty categorical field; the hex id ffffffffffffffff is reserved for it

_COLUMNS = ["label"] + [f"i{j + 1}" for j in range(NUM_DENSE)] + [f"c{j + 1}" for j in range(NUM_SPARSE)]
# Typical magnitude of each synthetic count feature (Criteo's are counts of very mixed size).
_DENSE_SCALES = np.array([1, 3, 10, 30, 100, 300, 1000, 2, 5, 20, 50, 200, 500], np.float64)
_PROBLEMS = {1: "wrong field count", 2: "label not 0/1", 3: "non-integer dense field",
             4: "non-hex categorical field", 5: "reserved id ffffffffffffffff"}
_MAX_WARNINGS = 3


class DataError(RuntimeError):
    """A data file the job cannot use: missing, unreadable, empty, without a usable row,
    or not enough rows for the ranks. The message names the file and the reason."""


class Batch(NamedTuple):
    """One batch of Criteo samples.

    Shape:
        dense (Tensor): (B, 13) float32, log1p of the non-negative counts.
        sparse (Tensor): (B, 26) int64, one raw id per feature (``EMPTY_ID`` if missing).
        labels (Tensor): (B,) float32, 0 or 1.
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted one half).

    Args:
        scores (Tensor): (n,) any float dtype.
        labels (Tensor): (n,) 0/1.

    Returns:
        The AUC, or ``nan`` when only one class is present.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels) > 0.5
    positives, negatives = int(y.sum()), int((~y).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based, ties averaged
    rank_sum = average_rank[inverse][y].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


# --- counter-based randomness: splitmix64 on numpy uint64, wrapping on overflow -----------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that scrambles every bit."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")


def _salt(seed: int, stream: int) -> np.ndarray:
    return _mix(_mix(np.array([seed & (2**64 - 1)], np.uint64)) ^ np.uint64(stream))


def _uniform(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniforms in the open interval (0, 1)."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _normal(h: np.ndarray) -> np.ndarray:
    return torch.special.ndtri(torch.from_numpy(_uniform(h))).numpy()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class SyntheticCriteo:
    """A deterministic, learnable Criteo-like data set.

    Sample ``i`` depends only on ``seed`` and ``i`` (each of its draws is a hash of
    ``(seed, i, field)``), so the data do not depend on ``batch_size`` or on the ranks.
    Feature ``f`` draws a popularity rank ``k`` from P(k) ~ (k + 1)^-alpha over
    ``max(1, round(CRITEO_CARDINALITIES[f] * scale))`` values; its raw id is a bijective
    64-bit hash of ``(seed, f, k)``, so ids spread over all of int64 and never collide.
    Dense features are log1p of exponentially distributed counts. A hidden model sets
    P(label = 1) = sigmoid(bias + signal * (sum_f effect(f, id_f) + dense @ w)), with
    effect(f, id) ~ Normal(0, 1/26) a hash of ``(seed, f, id)`` and the bias chosen so
    that about a quarter of the labels are 1.

    Args:
        num_samples (int): samples over all ranks, global indices ``start + [0, n)``.
        batch_size (int): samples per batch; the last batch may be smaller.
        scale (float): multiplies every table's number of distinct ids.
        alpha (float): power-law exponent of the id popularity.
        seed (int): selects the ids, the hidden model and the samples.
        rank (int): this rank takes the samples with ``(i - start) % world_size == rank``.
        world_size (int): number of ranks.
        signal (float): strength of the hidden model; 0 makes labels pure noise.
        start (int): first global sample index (e.g. a held-out set after the training one).

    Example::

        train = SyntheticCriteo(1_000_000, 1024, scale=0.1)
        held_out = SyntheticCriteo(50_000, 1024, scale=0.1, start=1_000_000)
    """

    _SAMPLES, _IDS, _EFFECTS, _WEIGHTS, _FRESH = range(5)
    _LABEL_RATE = 0.25

    def __init__(self, num_samples: int, batch_size: int, *, scale: float = 1.0,
                 alpha: float = 1.05, seed: int = 0, rank: int = 0, world_size: int = 1,
                 signal: float = 1.0, start: int = 0) -> None:
        if num_samples < 0 or batch_size <= 0 or scale <= 0 or alpha < 0 or start < 0:
            raise ValueError("need num_samples >= 0, batch_size > 0, scale > 0, alpha >= 0, start >= 0")
        _check_rank(rank, world_size)
        self.num_samples, self.batch_size, self.alpha, self.seed = num_samples, batch_size, alpha, seed
        self.rank, self.world_size, self.signal, self.start = rank, world_size, signal, start
        self.cardinalities = [max(1, round(c * scale)) for c in CRITEO_CARDINALITIES]
        self._local = max(0, -(-(num_samples - rank) // world_size))  # this rank's samples
        features = np.arange(NUM_SPARSE, dtype=np.uint64)
        self._id_salt = _salt(seed, self._IDS)
        self._effect_salts = _mix(_salt(seed, self._EFFECTS) + features)  # (26,)
        self._weights = _normal(_mix(_salt(seed, self._WEIGHTS) + np.arange(NUM_DENSE, dtype=np.uint64)))
        self._weights *= 0.5 / math.sqrt(NUM_DENSE)  # categorical effects carry most signal
        self._bias = self._calibrate_bias()

    def __len__(self) -> int:
        return -(-self._local // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for first in range(0, self._local, self.batch_size):
            j = np.arange(first, min(first + self.batch_size, self._local), dtype=np.int64)
            yield self.samples(torch.from_numpy(self.start + self.rank + j * self.world_size))

    def samples(self, indices: torch.Tensor) -> Batch:
        """The samples with the given global indices (any rank's, any order).

        Args:
            indices (Tensor): (B,) int64 global sample indices.
        """
        return self._make(indices.cpu().numpy().astype(np.uint64), self._SAMPLES)

    def true_probabilities(self, batch: Batch) -> torch.Tensor:
        """Ground-truth P(label = 1), recomputed from a batch's ids and dense values.

        Returns:
            Tensor: (B,) float32.
        """
        probabilities = self._probabilities(batch.dense.cpu().numpy(), batch.sparse.cpu().numpy())
        return torch.from_numpy(probabilities).float()

    def bayes_auc(self, num_samples: int = 20000) -> float:
        """AUC of the true probabilities on fresh samples: the best a model can reach."""
        batch = self._make(np.arange(num_samples, dtype=np.uint64), self._FRESH)
        return roc_auc(self.true_probabilities(batch), batch.labels)

    def _make(self, indices: np.ndarray, stream: int) -> Batch:
        dense, ids, u_label = self._features(indices, stream)
        labels = (u_label < self._probabilities(dense, ids)).astype(np.float32)
        return Batch(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(labels))

    def _features(self, indices: np.ndarray, stream: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dense (B, 13) float32, ids (B, 26) int64 and the label's uniform (B,) of samples."""
        base = _mix(_salt(self.seed, stream) + indices)[:, None]  # (B, 1)
        u = _uniform(_mix(base ^ _mix(np.arange(NUM_SPARSE + NUM_DENSE + 1, dtype=np.uint64))))
        card = np.array(self.cardinalities, np.float64)
        if abs(self.alpha - 1.0) < 1e-9:  # the inverse CDF's limit at alpha = 1
            x = (card + 1.0) ** u[:, :NUM_SPARSE]
        else:
            a = 1.0 - self.alpha
            x = (((card + 1.0) ** a - 1.0) * u[:, :NUM_SPARSE] + 1.0) ** (1.0 / a)
        k = np.minimum(np.floor(x) - 1.0, card - 1.0).clip(0).astype(np.uint64)  # (B, 26)
        ids = _mix(self._id_salt + ((np.arange(NUM_SPARSE, dtype=np.uint64) << np.uint64(32)) | k))
        counts = np.floor(-np.log1p(-u[:, NUM_SPARSE:-1]) * _DENSE_SCALES)
        return np.log1p(counts).astype(np.float32), ids.view(np.int64), u[:, -1]

    def _scores(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The hidden model's logit before bias and signal: (B, 13), (B, 26) -> (B,) float64."""
        effects = _normal(_mix(ids.view(np.uint64) ^ self._effect_salts)) / math.sqrt(NUM_SPARSE)
        return np.where(ids == EMPTY_ID, 0.0, effects).sum(1) + dense.astype(np.float64) @ self._weights

    def _probabilities(self, dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return _sigmoid(self._bias + self.signal * self._scores(dense, ids))

    def _calibrate_bias(self) -> float:
        """Bisects the bias that makes the mean true probability ``_LABEL_RATE``."""
        dense, ids, _ = self._features(np.arange(8192, dtype=np.uint64) + np.uint64(2**40), self._FRESH)
        scores = self.signal * self._scores(dense, ids)
        low, high = -30.0, 30.0
        for _ in range(60):  # the mean probability grows with the bias
            mid = (low + high) / 2
            low, high = (mid, high) if _sigmoid(mid + scores).mean() < self._LABEL_RATE else (low, mid)
        return (low + high) / 2


# --- the Criteo file formats --------------------------------------------------------------


def _format_hex(ids: np.ndarray) -> np.ndarray:
    """(n, m) int64 ids -> (n, m) 'S16' lowercase hex of their 64 bits, b'' for EMPTY_ID."""
    nibbles = (ids.view(np.uint64)[..., None] >> np.arange(60, -1, -4, dtype=np.uint64)) & np.uint64(15)
    text = np.frombuffer(b"0123456789abcdef", np.uint8)[nibbles]
    return np.where(ids == EMPTY_ID, b"", np.ascontiguousarray(text).view("S16")[..., 0])


def _fields(batch: Batch) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch as file fields: labels (B,), integer counts (B, 13), hex ids (B, 26)."""
    counts = np.rint(np.expm1(batch.dense.cpu().numpy().astype(np.float64))).clip(0).astype(np.int64)
    return batch.labels.cpu().numpy().astype(np.int64), counts, _format_hex(batch.sparse.cpu().numpy())


def write_tsv(path: str, batches: Iterable[Batch]) -> None:
    """Writes the Criteo day-file format: ``label \\t i1..i13 \\t c1..c26`` per line.

    Dense fields are written as the integers ``round(expm1(dense))``, ids as 16 lowercase
    hex digits of their 64 bits, ``EMPTY_ID`` as an empty field. ``.gz`` paths are gzipped.
    """
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as out:
        for batch in batches:
            labels, counts, ids = _fields(batch)
            table = np.concatenate([labels[:, None].astype("S"), counts.astype("S"), ids], axis=1)
            out.writelines(b"\t".join(row) + b"\n" for row in table.tolist())


def write_parquet(path: str, batches: Iterable[Batch]) -> None:
    """Writes Parquet with columns ``label`` (int8), ``i1..i13`` (int64) and ``c1..c26``
    (string, the hex of :func:`write_tsv`; null for ``EMPTY_ID``)."""
    schema = pa.schema([("label", pa.int8())] + [(c, pa.int64()) for c in _COLUMNS[1:1 + NUM_DENSE]]
                       + [(c, pa.string()) for c in _COLUMNS[1 + NUM_DENSE:]])
    with pq.ParquetWriter(path, schema) as writer:
        for batch in batches:
            labels, counts, ids = _fields(batch)
            columns = [pa.array(labels, pa.int8())] + [pa.array(c) for c in counts.T]
            columns += [pa.array(c.astype(object), pa.binary(), mask=c == b"").cast(pa.string())
                        for c in ids.T]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))


_HEX_DIGIT = np.full(256, 255, np.uint8)  # byte -> its hex value, 255 if not a hex digit
for _value, _char in enumerate(b"0123456789abcdef"):
    _HEX_DIGIT[_char] = _HEX_DIGIT[ord(chr(_char).upper())] = _value


def _parse_hex(text: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(n, m) 'S' hex fields -> ids (n, m) int64 (EMPTY_ID for b'') and problem (n,) int8."""
    length = np.strings.str_len(text)
    too_long = length > 16
    padded = np.strings.rjust(np.where(too_long, b"", text).astype("S16"), 16, b"0")
    digits = _HEX_DIGIT[padded.view(np.uint8)].reshape(text.shape + (16,))
    bad = too_long | (digits.view(np.uint64) & np.uint64(0xF0F0F0F0F0F0F0F0)).any(-1)
    value = ((digits[..., 0::2] << 4) | digits[..., 1::2]).view(">u8")[..., 0].astype(np.uint64)
    reserved = (length > 0) & (value == np.uint64(2**64 - 1))
    problem = np.where(bad.any(1), 4, np.where(reserved.any(1), 5, 0)).astype(np.int8)
    return np.where(length == 0, EMPTY_ID, value.view(np.int64)), problem


def _arrow_bytes(column: pa.Array) -> np.ndarray:
    """A string/binary column -> (n,) 'S' (null is b''), cut after 17 bytes (enough to see
    that an id is too long) without making a Python object per value."""
    column = pc.fill_null(column.cast(pa.binary()), b"")
    _, offsets, data = column.buffers()
    offsets = np.frombuffer(offsets, np.int32)[column.offset:column.offset + len(column) + 1]
    data = np.frombuffer(data, np.uint8) if data is not None and data.size else np.zeros(1, np.uint8)
    lengths, position = np.diff(offsets), np.arange(17)
    if len(lengths) and 0 < lengths[0] <= 17 and (lengths == lengths[0]).all():  # one width: a view
        return data[offsets[0]:offsets[-1]].view(f"S{lengths[0]}")
    chars = data[np.minimum(offsets[:-1, None] + position, len(data) - 1)]
    return np.where(position < lengths[:, None], chars, 0).astype(np.uint8).view("S17")[:, 0]


class _Block(NamedTuple):
    """Parsed rows of one file; the rows with ``problem != 0`` are skipped."""

    path: str
    rows: np.ndarray  # (n,) int64 line (TSV, from 1) or row (Parquet, from 0) numbers
    labels: np.ndarray  # (n,) int64
    counts: np.ndarray  # (n, 13) int64
    ids: np.ndarray  # (n, 26) int64
    problem: np.ndarray  # (n,) int8, a key of _PROBLEMS or 0


def _batch(labels: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> Batch:
    """Parsed fields (B,), (B, 13), (B, 26) int64 -> a Batch; negative counts become 0."""
    dense = np.log1p(counts.clip(0).astype(np.float64)).astype(np.float32)
    return Batch(torch.from_numpy(dense), torch.from_numpy(np.ascontiguousarray(ids)),
                 torch.from_numpy(labels.astype(np.float32)))


class _BackgroundReader:
    """Parses ahead on a background thread into a bounded queue; see :class:`CriteoTsvReader`."""

    _unit = "row"

    def __init__(self, paths: Sequence[str], batch_size: int, *, rank: int = 0,
                 world_size: int = 1, prefetch: int = 4) -> None:
        if batch_size <= 0 or prefetch <= 0:
            raise ValueError(f"batch_size ({batch_size}) and prefetch ({prefetch}) must be > 0")
        _check_rank(rank, world_size)
        self.paths, self.batch_size, self.prefetch = list(paths), batch_size, prefetch
        self.rank, self.world_size = rank, world_size
        self.rows_read = 0  # valid rows handed out in the current pass
        self.malformed = 0  # rows skipped in the current pass, as far as the thread has parsed
        self.first_problem: Optional[str] = None  # "path:row (reason)" of this pass's first skip

    def __iter__(self) -> Iterator[Batch]:
        self.rows_read, self.malformed, self.first_problem = 0, 0, None
        items: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(items, stop), daemon=True)
        worker.start()
        try:
            while True:
                try:
                    item = items.get(timeout=0.1)
                except queue.Empty:
                    if worker.is_alive() or not items.empty():
                        continue
                    raise DataError(f"{type(self).__name__}: the reader thread died")
                if isinstance(item, BaseException):
                    raise DataError(f"{type(self).__name__} failed: {item}") from item
                batch, self.malformed = item
                if batch is None:
                    return
                self.rows_read += len(batch.labels)
                yield batch
        finally:  # also when the consumer stops early: the thread sees `stop` at its next put
            stop.set()
            worker.join(timeout=10.0)

    def _produce(self, items: "queue.Queue", stop: threading.Event) -> None:
        def put(item) -> bool:  # gives up once the consumer has gone
            while not stop.is_set():
                try:
                    items.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            for item in self._batches(stop):
                if not put(item):
                    return
        except BaseException as error:  # handed to the consumer, never lost in the thread
            put(error)

    def _batches(self, stop: threading.Event) -> Iterator[Tuple[Optional[Batch], int]]:
        """This pass's batches, each with the number of rows skipped so far; then (None, total)."""
        malformed, kept, size = 0, [], 0
        for block in self._blocks():
            malformed += self._report(block, malformed)
            ok = block.problem == 0
            kept.append((block.labels[ok], block.counts[ok], block.ids[ok]))
            size += int(ok.sum())
            if size >= self.batch_size:
                labels, counts, ids = map(np.concatenate, zip(*kept))
                whole = size - size % self.batch_size
                for start in range(0, whole, self.batch_size):
                    end = start + self.batch_size
                    yield _batch(labels[start:end], counts[start:end], ids[start:end]), malformed
                kept, size = [(labels[whole:], counts[whole:], ids[whole:])], size - whole
            if stop.is_set():
                return
        if size:
            yield _batch(*map(np.concatenate, zip(*kept))), malformed
        if malformed > _MAX_WARNINGS:
            logger.warning("%s: skipped %d malformed %ss in this pass", type(self).__name__,
                           malformed, self._unit)
        yield None, malformed

    def _report(self, block: _Block, seen: int) -> int:
        bad = np.flatnonzero(block.problem)
        if len(bad) and self.first_problem is None:
            self.first_problem = (f"{self._unit} {block.path}:{block.rows[bad[0]]} "
                                  f"({_PROBLEMS[int(block.problem[bad[0]])]})")
        for j in bad[:max(0, _MAX_WARNINGS - seen)]:
            logger.warning("%s: skipping malformed %s %s:%d (%s)", type(self).__name__, self._unit,
                           block.path, block.rows[j], _PROBLEMS[int(block.problem[j])])
        return len(bad)

    def _blocks(self) -> Iterator[_Block]:
        first = 0  # global index of the file's first row
        for path in self.paths:
            try:
                first += yield from self._file_blocks(path, first)
            except Exception as error:
                raise DataError(f"error reading {path}: {error!r}") from error

    def _file_blocks(self, path: str, first: int) -> Generator[_Block, None, int]:
        """Yields this rank's rows of ``path`` in blocks; returns the file's number of rows."""
        raise NotImplementedError


class CriteoTsvReader(_BackgroundReader):
    """Streams :class:`Batch` es from Criteo TSV day files (``.gz`` ones too).

    A background thread parses ahead into a queue of ``prefetch`` batches; an error there
    is raised in the consumer, naming the file. Rank ``r`` takes the lines whose global
    index (counted across ``paths`` in order) is ``r`` modulo ``world_size``. A malformed
    line (field count, label not 0/1, non-integer dense, non-hex or reserved id) is
    skipped and counted in ``malformed``; the first three are logged with file and line.
    Negative dense values are clamped to 0. Each ``iter()`` is a fresh pass, and
    ``rows_read`` counts the rows handed out in it.

    Args:
        paths (Sequence[str]): the files, read in this order.
        batch_size (int): rows per batch; the last batch may be smaller.
        rank (int): this reader's rank.
        world_size (int): number of ranks.
        prefetch (int): batches parsed ahead.
    """

    _unit = "line"
    _BLOCK_LINES = 4096

    def _file_blocks(self, path: str, first: int) -> Generator[_Block, None, int]:
        lines, numbers, count = [], [], 0
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as source:
            for count, line in enumerate(source, start=1):
                if (first + count - 1) % self.world_size == self.rank:
                    lines.append(line)
                    numbers.append(count)
                    if len(lines) == self._BLOCK_LINES:
                        yield self._parse(path, lines, numbers)
                        lines, numbers = [], []
        if lines:
            yield self._parse(path, lines, numbers)
        return count

    @staticmethod
    def _parse(path: str, lines: List[bytes], numbers: List[int]) -> _Block:
        width = 1 + NUM_DENSE + NUM_SPARSE
        split = [line.rstrip(b"\r\n").split(b"\t") for line in lines]
        wrong = np.array([len(fields) != width for fields in split])
        table = np.array([[b"0"] * width if w else f for f, w in zip(split, wrong)], np.bytes_)
        counts, dense_bad = _parse_counts(table[:, 1:1 + NUM_DENSE])
        ids, id_problem = _parse_hex(table[:, 1 + NUM_DENSE:])
        problem = np.select([wrong, ~np.isin(table[:, 0], [b"0", b"1"]), dense_bad], [1, 2, 3], id_problem)
        return _Block(path, np.array(numbers, np.int64), (table[:, 0] == b"1").astype(np.int64),
                      counts, ids, problem.astype(np.int8))


def _parse_counts(text: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(n, 13) 'S' integer fields ('' is 0) -> counts (n, 13) int64 and bad (n,) bool."""
    text = np.where(text == b"", b"0", text)
    try:
        return text.astype(np.int64), np.zeros(len(text), bool)
    except (ValueError, OverflowError):  # rare: find the bad fields one by one
        counts, bad = np.zeros(text.shape, np.int64), np.zeros(len(text), bool)
        for (i, j), field in np.ndenumerate(text):
            try:
                counts[i, j] = int(field)
            except (ValueError, OverflowError):
                bad[i] = True
        return counts, bad


class CriteoParquetReader(_BackgroundReader):
    """Streams :class:`Batch` es from Parquet files laid out as :func:`write_parquet` writes.

    Behaves as :class:`CriteoTsvReader` (same arguments), over global rows instead of
    lines: nulls are empty fields; a null or non-0/1 label or a non-hex id makes a row
    malformed. A missing column, or one that does not cast to its type, is an error.
    """

    _READ_ROWS = 65536

    def _file_blocks(self, path: str, first: int) -> Generator[_Block, None, int]:
        offset = 0
        for records in pq.ParquetFile(path).iter_batches(batch_size=self._READ_ROWS, columns=_COLUMNS):
            mine = np.flatnonzero((first + offset + np.arange(records.num_rows)) % self.world_size
                                  == self.rank)
            if len(mine):
                yield self._parse(path, records.take(pa.array(mine)), mine + offset)
            offset += records.num_rows
        return offset

    @staticmethod
    def _parse(path: str, records: pa.RecordBatch, rows: np.ndarray) -> _Block:
        def numbers(name: str, kind: pa.DataType, null: int) -> np.ndarray:
            return pc.fill_null(records.column(name).cast(kind), null).to_numpy(zero_copy_only=False)

        labels = numbers("label", pa.float64(), -1)  # float: a label 0.5 is malformed, not an error
        counts = np.stack([numbers(name, pa.int64(), 0) for name in _COLUMNS[1:1 + NUM_DENSE]], axis=1)
        text = np.stack([_arrow_bytes(records.column(name)) for name in _COLUMNS[1 + NUM_DENSE:]], axis=1)
        ids, problem = _parse_hex(text)
        problem = np.where(np.isin(labels, [0, 1]), problem, 2).astype(np.int8)
        return _Block(path, rows.astype(np.int64), labels.astype(np.int64), counts, ids, problem)
