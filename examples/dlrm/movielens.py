"""MovieLens-100K for the DLRM job: each rating is a sample, labelled 1 if ``rating >= 4``.

The files come from a folder holding either RecBole's atomic files (``ml-100k.inter``,
``ml-100k.user``, ``ml-100k.item``, tab-separated with a ``name:type`` header) or
GroupLens' originals (``u.data``, ``u.user``, ``u.item``). By default the folder is the
one the ``recbole`` wheel ships (``requirements-nodeps.txt``), found without importing
the package (its dependencies are not installed).

Each sample has :data:`NUM_DENSE` dense features and one id per categorical feature
(:data:`FEATURES`). The user and item ids are the files' raw ids (the dynamic tables'
keys); each side feature's id is the index of its value among that feature's sorted
distinct values in the whole data set, so a static table of that many rows sees
``id mod rows == id`` and no two values share a row.

The split is by rating, not by time: a rating is held out for evaluation when a seeded
hash of its ``(user, item)`` pair falls in ``eval_fraction``; the training ratings are
shuffled once by another seeded hash of the pair (every pass has the same order). Both
depend only on the seed and the pairs, not on the files' line order or format.

Example::

    train = MovieLens(512, rank=0, world_size=2)            # the wheel's files
    held_out = MovieLens(512, split="eval", rank=0, world_size=2)
    for batch in train:
        ...  # batch.dense (512, 3), batch.sparse (512, 8), batch.labels (512,)
"""

import functools
import importlib.util
import os
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from data import Batch, DataError, _mix, _salt, _uniform

__all__ = ["FEATURES", "GENRES", "MovieLens", "NUM_DENSE", "default_folder", "load_movielens"]

FEATURES = ("user_id", "item_id", "age", "gender", "occupation", "zip3", "release_year",
            "first_genre")
# age / 100; (release year - 1900) / 100, 0 if unknown; number of genres / 6
NUM_DENSE = 3
# GroupLens' order of the 19 genre flags at the end of u.item (RecBole's names too)
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
          "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
          "Romance", "Sci-Fi", "Thriller", "War", "Western")
_RECBOLE = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")
_GROUPLENS = ("u.data", "u.user", "u.item")
_SPLIT, _ORDER = range(2)  # hash streams


def default_folder() -> str:
    """The ml-100k folder of the installed ``recbole`` wheel (the package is not run).

    Raises:
        DataError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("MovieLens: the recbole wheel is not installed (requirements-nodeps.txt); "
                        "install it or pass a folder of MovieLens-100K files")
    return os.path.join(spec.submodule_search_locations[0], "dataset_example", "ml-100k")


class _Ratings(NamedTuple):
    """Every rating of the data set as samples, sorted by (user, item)."""

    users: np.ndarray  # (N,) int64 raw user ids
    items: np.ndarray  # (N,) int64 raw item ids
    dense: np.ndarray  # (N, NUM_DENSE) float32
    sparse: np.ndarray  # (N, len(FEATURES)) int64
    labels: np.ndarray  # (N,) float32 0/1
    cardinalities: Tuple[int, ...]  # distinct values of each feature


def load_movielens(folder: Optional[str] = None) -> _Ratings:
    """Every rating of the folder's data set (cached while its files are unchanged).

    Args:
        folder: RecBole's or GroupLens' MovieLens-100K files (None: the wheel's).

    Raises:
        DataError: a missing folder or file, a malformed line (named by file and line)
            or no rating.
    """
    folder = default_folder() if folder is None else folder
    if not os.path.isdir(folder):
        raise DataError(f"MovieLens folder {folder}: no such directory")
    names = _RECBOLE if os.path.exists(os.path.join(folder, _RECBOLE[0])) else _GROUPLENS
    if not os.path.exists(os.path.join(folder, names[0])):
        raise DataError(f"MovieLens folder {folder}: holds neither RecBole's {_RECBOLE[0]} "
                        f"nor GroupLens' {_GROUPLENS[0]}")
    paths = tuple(os.path.join(os.path.abspath(folder), name) for name in names)
    stamps = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) if os.path.exists(p) else None
                   for p in paths)
    return _load(paths, stamps)


@functools.lru_cache(maxsize=4)
def _load(paths: Tuple[str, str, str], stamps: tuple) -> _Ratings:
    """Parses the three files; ``stamps`` (their mtimes and sizes) only key the cache."""
    del stamps
    recbole = os.path.basename(paths[0]) == _RECBOLE[0]
    users, items, ratings, numbers = _read_ratings(paths[0], recbole)
    people, movies = _read_users(paths[1], recbole), _read_items(paths[2], recbole)
    order = np.lexsort((items, users))
    users, items, ratings, numbers = users[order], items[order], ratings[order], numbers[order]
    person = [_lookup(people, u, paths[0], n, paths[1]) for u, n in zip(users.tolist(), numbers.tolist())]
    movie = [_lookup(movies, i, paths[0], n, paths[2]) for i, n in zip(items.tolist(), numbers.tolist())]
    age, gender, occupation, zip3 = zip(*person)
    year, genres = zip(*movie)
    first = [min(g) if g else len(GENRES) for g in genres]  # len(GENRES): no genre flag
    columns = [users, items] + [_codes(c) for c in (age, gender, occupation, zip3, year, first)]
    sparse = np.stack(columns, axis=1).astype(np.int64)
    year = np.array(year, np.float64)
    dense = np.stack([np.array(age, np.float64) / 100, np.where(year > 0, (year - 1900) / 100, 0.0),
                      np.array([len(g) for g in genres], np.float64) / 6], axis=1).astype(np.float32)
    out = _Ratings(users, items, dense, sparse, (ratings >= 4).astype(np.float32),
                   tuple(len(np.unique(c)) for c in sparse.T))
    for array in out[:5]:
        array.setflags(write=False)  # shared by every reader of the cache
    return out


def _lookup(table: Dict[int, tuple], key: int, ratings: str, number: int, listing: str) -> tuple:
    """``table[key]``, read from ``listing``, for the rating at line ``number``."""
    try:
        return table[key]
    except KeyError:
        raise DataError(f"{ratings}:{number}: id {key} is not in {listing}") from None


def _codes(values: Sequence) -> np.ndarray:
    """Each value's index among the sorted distinct values."""
    return np.unique(np.array(values), return_inverse=True)[1].reshape(-1)


def _lines(path: str, separator: str) -> Iterator[Tuple[int, List[str]]]:
    """The non-blank lines' numbers (from 1) and fields. A file is decoded as Latin-1
    (GroupLens' titles are), which never fails."""
    try:
        with open(path, encoding="latin-1") as source:
            for number, line in enumerate(source, start=1):
                if line.strip():
                    yield number, line.rstrip("\r\n").split(separator)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None


def _rows(path: str, recbole: bool, names: Sequence[str], width: int
          ) -> Iterator[Tuple[int, List[str]]]:
    """Each line's number and fields: RecBole's columns ``names`` found by its header;
    all of GroupLens' ``width`` fields (``|``-separated, tabs in ``u.data``)."""
    separator = "\t" if recbole or path.endswith("u.data") else "|"
    lines = _lines(path, separator)
    if recbole:
        first = next(lines, None)
        if first is None:
            raise DataError(f"{path}: the file is empty")
        header = [field.split(":")[0] for field in first[1]]
        missing = [name for name in names if name not in header]
        if missing:
            raise DataError(f"{path}:{first[0]}: the header has no column {', '.join(missing)}")
        columns, width = [header.index(name) for name in names], len(header)
    else:
        columns = list(range(len(names)))
    for number, fields in lines:
        if len(fields) != width:
            raise DataError(f"{path}:{number}: {len(fields)} fields, expected {width}")
        yield number, [fields[c] for c in columns] if recbole else fields


def _integer(text: str, path: str, number: int, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataError(f"{path}:{number}: {what} {text!r} is not an integer") from None


def _read_ratings(path: str, recbole: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Users (N,) int64, items (N,) int64, ratings (N,) float64 and line numbers (N,)
    int64, in file order."""
    users, items, ratings, numbers = [], [], [], []
    for number, fields in _rows(path, recbole, ("user_id", "item_id", "rating"), 4):
        numbers.append(number)
        users.append(_integer(fields[0], path, number, "user id"))
        items.append(_integer(fields[1], path, number, "item id"))
        try:
            rating = float(fields[2])
        except ValueError:
            rating = float("nan")
        if not np.isfinite(rating):
            raise DataError(f"{path}:{number}: rating {fields[2]!r} is not a number")
        ratings.append(rating)
    if not users:
        raise DataError(f"{path}: no ratings")
    return (np.array(users, np.int64), np.array(items, np.int64), np.array(ratings, np.float64),
            np.array(numbers, np.int64))


def _read_users(path: str, recbole: bool) -> Dict[int, Tuple[int, str, str, str]]:
    """``{user id: (age, gender, occupation, zip code's first 3 characters)}``."""
    names = ("user_id", "age", "gender", "occupation", "zip_code")
    users = {}
    for number, fields in _rows(path, recbole, names, 5):
        user = _integer(fields[0], path, number, "user id")
        users[user] = (_integer(fields[1], path, number, "age"), fields[2].strip(),
                       fields[3].strip(), fields[4].strip()[:3].upper())
    return users


def _read_items(path: str, recbole: bool) -> Dict[int, Tuple[int, Tuple[int, ...]]]:
    """``{item id: (release year or 0 if unknown, its genres' indices in GENRES)}``."""
    names = ("item_id", "release_year", "class") if recbole else ("item_id",)
    items = {}
    for number, fields in _rows(path, recbole, names, 5 + len(GENRES)):
        item = _integer(fields[0], path, number, "item id")
        if recbole:  # release_year "1995" (or a token like "unknown"), class "Action Comedy"
            year, genres = fields[1].strip(), []
            for name in fields[2].split():
                if name not in GENRES:
                    raise DataError(f"{path}:{number}: unknown genre {name!r}")
                genres.append(GENRES.index(name))
        else:  # ... | release date "01-Jan-1995" | video date | URL | 19 genre flags
            year, flags = fields[2].strip()[-4:], fields[5:]
            if any(flag not in ("0", "1") for flag in flags):
                raise DataError(f"{path}:{number}: genre flags must be 0 or 1")
            genres = [g for g, flag in enumerate(flags) if flag == "1"]
        items[item] = (int(year) if len(year) == 4 and year.isdigit() else 0, tuple(sorted(genres)))
    return items


class MovieLens:
    """The training or held-out ratings of MovieLens-100K as the job's :class:`Batch` es.

    Sample ``i`` of the split (in the split's order: shuffled for ``"train"``, by
    ``(user, item)`` for ``"eval"``) goes to rank ``i % world_size``; the last
    ``len % world_size`` samples are left out, so that every rank has as many samples and
    the ranks' batches have one size at each step (TorchRec's pooled all-to-all takes one
    batch size). Each rank's batches are consecutive runs of its samples, the last one
    possibly smaller. Every pass yields the same batches.

    Args:
        batch_size (int): samples per batch.
        split (str): ``"train"`` or ``"eval"`` (the held-out ratings).
        folder (str): RecBole's or GroupLens' files (None: the recbole wheel's).
        seed (int): selects the split and the training order.
        rank (int): this rank.
        world_size (int): number of ranks.
        eval_fraction (float): the share of ratings held out.

    Attributes:
        cardinalities (Tuple[int, ...]): distinct values of each feature in the whole
            data set (both splits): the tables' rows.
        num_samples (int): the split's samples over all ranks (a multiple of
            ``world_size``).

    Raises:
        DataError: as :func:`load_movielens`.
    """

    def __init__(self, batch_size: int, *, split: str = "train", folder: Optional[str] = None,
                 seed: int = 0, rank: int = 0, world_size: int = 1, eval_fraction: float = 0.1) -> None:
        if batch_size <= 0 or split not in ("train", "eval") or not 0 < eval_fraction < 1:
            raise ValueError("need batch_size > 0, split 'train' or 'eval', 0 < eval_fraction < 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, world_size={world_size})")
        self.batch_size, self.split, self.rank, self.world_size = batch_size, split, rank, world_size
        self._data = load_movielens(folder)
        self.cardinalities = self._data.cardinalities
        pairs = _mix(_mix(self._data.users.view(np.uint64) ^ _salt(seed, _SPLIT))
                     + self._data.items.view(np.uint64))
        held_out = _uniform(pairs) < eval_fraction
        order = np.flatnonzero(held_out if split == "eval" else ~held_out)
        if split == "train":  # a stable sort: equal hashes keep the (user, item) order
            order = order[np.argsort(_mix(pairs[order] ^ _salt(seed, _ORDER)), kind="stable")]
        order = order[:len(order) - len(order) % world_size]  # one count per rank
        self.num_samples = len(order)
        self._mine = order[rank::world_size]

    def __len__(self) -> int:
        return -(-len(self._mine) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        data = self._data
        for first in range(0, len(self._mine), self.batch_size):
            rows = self._mine[first:first + self.batch_size]
            yield Batch(torch.from_numpy(data.dense[rows]), torch.from_numpy(data.sparse[rows]),
                        torch.from_numpy(data.labels[rows]))
