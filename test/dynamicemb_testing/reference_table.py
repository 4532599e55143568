"""A pure-Python reference model of ``ScoredHashTable``.

Written from the contract in ``docs/ARCHITECTURE.md`` ("The scored hash table"), independently
of the implementation, so that tests can compare the real table with it slot for slot.
Plain Python only (ints, lists, dicts): no torch in the core logic. Speed matters only so far
as a few hundred thousand keys must stay cheap: hits use a dict, the empty slot an insert
takes (the first at or after the key's start offset, wrapping) comes from a sorted list of
free offsets.
"""

import bisect
import dataclasses
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MAX_TABLES = 32767
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

STRATEGIES = ("LRU", "STEP", "LFU", "CUSTOMIZED", "NO_EVICTION", "LRU_LFU")
#: LRU_LFU: count in bits 62..32 (saturating at 2^31 - 1) above the clock in bits 31..0.
COMPOUND_MAX_COUNT = 2**31 - 1
CHECK_MODES = ("ERROR", "WARNING", "IGNORE")


def ref_hash(table_id: int, key: int) -> int:
    """The table's uint64 hash of ``(table_id, key)``, per ARCHITECTURE.md."""
    x = ((key & MASK64) + (((table_id + 1) * GOLDEN) & MASK64)) & MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def ref_bucket(h: int, num_buckets: int) -> int:
    return h & (num_buckets - 1)


def start_offset(h: int, bucket_capacity: int) -> int:
    """Where the key's inserts and probes start in its bucket: the first slot of one of
    its bucket_capacity / 16 groups, from bits 32..63 of the hash."""
    return 16 * ((((h >> 32) & 0xFFFFFFFF) * (bucket_capacity // 16)) >> 32)


def ref_digest(h: int) -> int:
    """Top byte of the hash; 0 is reserved for empty slots, so it becomes 1."""
    return (h >> 56) or 1


def to_uint64(x: int) -> int:
    return x & MASK64


def to_int64(x: int) -> int:
    x &= MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def rounded_num_buckets(capacity: int, bucket_capacity: int) -> int:
    """Smallest power of two ``nb`` with ``nb * bucket_capacity >= capacity`` (at least 1)."""
    nb = 1
    while nb * bucket_capacity < capacity:
        nb *= 2
    return nb


def strategy_name(strategy) -> str:
    """Accepts a ``DynamicEmbScoreStrategy`` member or a name; TIMESTAMP means LRU."""
    name = getattr(strategy, "name", strategy)
    name = str(name).upper()
    if name == "TIMESTAMP":
        name = "LRU"
    if name not in STRATEGIES:
        raise ValueError(f"unknown score strategy {strategy!r}")
    return name


def check_mode_name(mode) -> str:
    name = str(getattr(mode, "name", mode)).upper()
    if name not in CHECK_MODES:
        raise ValueError(f"unknown check mode {mode!r}")
    return name


class RefEvicted(NamedTuple):
    keys: List[int]
    table_ids: List[int]
    scores: List[int]
    slots: List[int]
    values: List[Tuple[float, ...]]


class RefInsertResult(NamedTuple):
    slots: List[int]
    inserted: List[bool]
    evicted: Optional[RefEvicted]


class RefExported(NamedTuple):
    keys: List[int]
    table_ids: List[int]
    scores: List[int]
    slots: List[int]
    values: List[Tuple[float, ...]]


@dataclasses.dataclass
class RefStats:
    inserts: int = 0
    evictions: int = 0
    failed_inserts: int = 0
    erases: int = 0
    growths: int = 0


@dataclasses.dataclass
class _Slots:
    """Per-slot state, one list entry per slot."""

    occupied: List[bool]
    keys: List[int]
    tids: List[int]
    scores: List[int]
    values: List[Tuple[float, ...]]
    hashes: List[int]
    pinned: List[bool]

    @classmethod
    def empty(cls, n: int, value_dim: int) -> "_Slots":
        zero = (0.0,) * value_dim
        return cls([False] * n, [0] * n, [0] * n, [0] * n, [zero] * n, [0] * n, [False] * n)

    def copy(self) -> "_Slots":
        return _Slots(*(list(getattr(self, f.name)) for f in dataclasses.fields(self)))


class ReferenceHashTable:
    """Dict-and-list model of ``ScoredHashTable`` with the same constructor and verbs.

    Inputs are Python sequences (``keys``, ``table_ids``, ``scores`` of ints, ``values`` of
    rows of floats); outputs are Python lists and the ``Ref*`` named tuples above.
    """

    def __init__(
        self,
        num_tables: int = 1,
        capacity: int = 1024,
        bucket_capacity: int = 128,
        score_strategy="LRU",
        max_load_factor: float = 0.5,
        max_capacity: Optional[int] = None,
        value_dim: int = 0,
        value_dtype=None,
        check_mode="IGNORE",
        device=None,
    ):
        del value_dtype, device  # values are modelled as floats already rounded by the caller
        if not 1 <= num_tables <= MAX_TABLES:
            raise ValueError(f"num_tables must be in [1, {MAX_TABLES}], got {num_tables}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if bucket_capacity <= 0 or bucket_capacity % 16:
            raise ValueError(f"bucket_capacity must be a positive multiple of 16, got {bucket_capacity}")
        if not 0.0 < max_load_factor <= 1.0:
            raise ValueError(f"max_load_factor must be in (0, 1], got {max_load_factor}")
        if value_dim < 0:
            raise ValueError(f"value_dim must be >= 0, got {value_dim}")
        self.num_tables = num_tables
        self.bucket_capacity = bucket_capacity
        self.strategy = strategy_name(score_strategy)
        self.check_mode = check_mode_name(check_mode)
        self.max_load_factor = max_load_factor
        self.value_dim = value_dim
        self.num_buckets = rounded_num_buckets(capacity, bucket_capacity)
        max_nb = rounded_num_buckets(capacity if max_capacity is None else max_capacity, bucket_capacity)
        if max_nb < self.num_buckets:
            raise ValueError(f"max_capacity {max_capacity} is below capacity {capacity}")
        self.max_num_buckets = max_nb
        self.clock = 0
        self.step = 0
        self.stats = RefStats()
        self._reset_slots()

    # ----------------------------------------------------------------- geometry
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_capacity

    def max_capacity(self) -> int:
        return self.max_num_buckets * self.bucket_capacity

    def size(self) -> int:
        return len(self._index)

    def load_factor(self) -> float:
        return self.size() / self.capacity()

    def value_of(self, slot: int) -> Tuple[float, ...]:
        return self._s.values[slot]

    def _reset_slots(self) -> None:
        self._s = _Slots.empty(self.capacity(), self.value_dim)
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        s, bc = self._s, self.bucket_capacity
        self._index: Dict[Tuple[int, int], int] = {}
        self._free: List[List[int]] = [[] for _ in range(self.num_buckets)]
        for slot in range(self.capacity()):
            if s.occupied[slot]:
                self._index[(s.tids[slot], s.keys[slot])] = slot
            else:
                self._free[slot // bc].append(slot % bc)  # ascending: already a heap

    def _relayout(self, old: _Slots) -> None:
        """Places every occupied slot of ``old`` at the same offset of its bucket under the
        current ``num_buckets`` (growth and the ERROR undo share this)."""
        bc, nb = self.bucket_capacity, self.num_buckets
        new = _Slots.empty(self.capacity(), self.value_dim)
        src = [slot for slot, occ in enumerate(old.occupied) if occ]
        dst = [(old.hashes[slot] & (nb - 1)) * bc + slot % bc for slot in src]
        assert len(set(dst)) == len(dst), "growth collided: offsets are not preserved"
        for f in dataclasses.fields(_Slots):
            old_col, new_col = getattr(old, f.name), getattr(new, f.name)
            for a, b in zip(src, dst):
                new_col[b] = old_col[a]
        self._s = new
        self._rebuild_index()

    def _grow(self) -> None:
        self.num_buckets *= 2
        self.stats.growths += 1
        self._relayout(self._s)

    # ----------------------------------------------------------------- checks
    def _tids(self, keys: Sequence[int], table_ids: Optional[Sequence[int]]) -> List[int]:
        for k in keys:
            if not INT64_MIN <= k <= INT64_MAX:
                raise ValueError(f"key {k} is not an int64")
        if table_ids is None:
            return [0] * len(keys)
        if len(table_ids) != len(keys):
            raise ValueError("table_ids must have the length of keys")
        for t in table_ids:
            if not 0 <= t < self.num_tables:
                raise ValueError(f"table id {t} not in [0, {self.num_tables})")
        return list(table_ids)

    def _check_scores(self, n: int, scores: Optional[Sequence[int]]) -> None:
        """CUSTOMIZED: scores required, >= 0. LFU, LRU_LFU: optional occurrence counts, >= 1."""
        if scores is None:
            if self.strategy == "CUSTOMIZED":
                raise ValueError("scores are required by the CUSTOMIZED strategy")
            return
        if self.strategy not in ("CUSTOMIZED", "LFU", "LRU_LFU"):
            raise ValueError(f"scores are only taken by CUSTOMIZED (and as counts by LFU), not {self.strategy}")
        if len(scores) != n:
            raise ValueError("scores must have the length of keys")
        low = 1 if self.strategy in ("LFU", "LRU_LFU") else 0
        if any(not low <= x <= INT64_MAX for x in scores):
            raise ValueError(f"scores must be int64 >= {low}")

    def _check_values(self, n: int, values) -> List[Tuple[float, ...]]:
        if values is None:
            if self.value_dim:
                raise ValueError("values are required when value_dim > 0")
            return [()] * n
        rows = [tuple(float(v) for v in row) for row in values]
        if len(rows) != n or any(len(r) != self.value_dim for r in rows):
            raise ValueError(f"values must be ({n}, {self.value_dim})")
        return rows

    # ----------------------------------------------------------------- score rules
    def _score_on_insert(self, i: int, scores) -> int:
        if self.strategy in ("LRU", "NO_EVICTION"):
            return self.clock
        if self.strategy == "STEP":
            return self.step
        if self.strategy == "LFU":
            return 1 if scores is None else scores[i]  # the occurrence count
        if self.strategy == "LRU_LFU":
            return self._compound(0, scores, i)
        return scores[i]

    def _compound(self, count: int, scores, i: int) -> int:
        count = min(count + (1 if scores is None else scores[i]), COMPOUND_MAX_COUNT)
        return (count << 32) | (self.clock & 0xFFFFFFFF)

    def _score_on_hit(self, old: int, i: int, scores) -> int:
        if self.strategy == "LFU":  # saturates at the largest int64
            return min(old + (1 if scores is None else scores[i]), 2**63 - 1)
        if self.strategy == "LRU_LFU":
            return self._compound(old >> 32, scores, i)
        return self._score_on_insert(i, scores)

    # ----------------------------------------------------------------- read-only verbs
    def find(self, keys: Sequence[int], table_ids: Optional[Sequence[int]] = None) -> List[int]:
        tids = self._tids(keys, table_ids)
        return [self._index.get((t, k), -1) for k, t in zip(keys, tids)]

    def export_batch(self, start: int = 0, count: Optional[int] = None, min_score: Optional[int] = None) -> RefExported:
        s = self._s
        end = self.capacity() if count is None else min(self.capacity(), start + count)
        out = RefExported([], [], [], [], [])
        for slot in range(max(0, start), end):
            # LRU_LFU: min_score is compared with the time, the low 32 bits
            time = s.scores[slot] & 0xFFFFFFFF if self.strategy == "LRU_LFU" else s.scores[slot]
            if s.occupied[slot] and (min_score is None or time >= min_score):
                out.keys.append(s.keys[slot])
                out.table_ids.append(s.tids[slot])
                out.scores.append(s.scores[slot])
                out.slots.append(slot)
                out.values.append(s.values[slot])
        return out

    # ----------------------------------------------------------------- mutating verbs
    def erase(self, keys: Sequence[int], table_ids: Optional[Sequence[int]] = None) -> List[bool]:
        tids = self._tids(keys, table_ids)
        out = []
        for k, t in zip(keys, tids):
            slot = self._index.pop((t, k), None)
            out.append(slot is not None)
            if slot is not None:
                self._s.occupied[slot] = False
                bisect.insort(self._free[slot // self.bucket_capacity], slot % self.bucket_capacity)
                self.stats.erases += 1
        return out

    def clear(self) -> None:
        self._reset_slots()

    def set_step(self, step: int) -> None:
        if not 0 <= step <= INT64_MAX:
            raise ValueError(f"step must be a non-negative int64, got {step}")
        self.step = step

    def find_or_insert(self, keys, table_ids=None, scores=None) -> RefInsertResult:
        return self._insert("find_or_insert", keys, table_ids, None, scores)

    def insert_or_assign(self, keys, values, table_ids=None, scores=None) -> RefInsertResult:
        return self._insert("insert_or_assign", keys, table_ids, values, scores)

    def insert_and_evict(self, keys, values, table_ids=None, scores=None) -> RefInsertResult:
        return self._insert("insert_and_evict", keys, table_ids, values, scores)

    # ----------------------------------------------------------------- the inserting procedure
    def _insert(self, verb, keys, table_ids, values, scores) -> RefInsertResult:
        keys = list(keys)
        n = len(keys)
        tids = self._tids(keys, table_ids)  # step 1: validate everything first
        self._check_scores(n, scores)
        rows = self._check_values(n, values) if verb != "find_or_insert" else None
        while self.size() > self.max_load_factor * self.capacity() and self.num_buckets < self.max_num_buckets:
            self._grow()  # step 2
        undo = (self._s.copy(), self.clock)
        self.clock += 1  # step 3 (every inserting call, every strategy)
        hashes = [ref_hash(t, k) for k, t in zip(keys, tids)]
        while True:  # steps 4 and 5
            landed = [False] * n
            inserted = [False] * n
            failed: List[int] = []
            victims: List[Tuple[int, int, int, int, int, Tuple[float, ...]]] = []
            self._pass(keys, tids, hashes, scores, landed, inserted, failed, victims)
            self._s.pinned = [False] * self.capacity()  # step 6
            if not failed or self.num_buckets == self.max_num_buckets:
                break
            self._relayout(undo[0])  # undone, then the table grows and the call runs again
            self._grow()
            undo = (self._s.copy(), self.clock - 1)
        self.stats.failed_inserts += len(failed)  # step 7
        if failed and self.check_mode == "ERROR":
            old, clock = undo
            self._relayout(old)  # contents as before, in the (possibly grown) current layout
            self.clock = clock
            raise RuntimeError(f"{len(failed)} keys could not be inserted")
        self.stats.inserts += sum(inserted)
        self.stats.evictions += len(victims)
        slots = [self._index[(tids[i], keys[i])] if landed[i] else -1 for i in range(n)]
        for i in range(n):  # step 8
            if verb == "find_or_insert":
                if inserted[i]:
                    self._s.values[slots[i]] = (0.0,) * self.value_dim
            elif landed[i]:
                self._s.values[slots[i]] = rows[i]
        evicted = None
        if verb != "insert_or_assign":
            victims.sort(key=lambda v: v[0])
            evicted = RefEvicted(*([v[j] for v in victims] for j in range(1, 6)))
        return RefInsertResult(slots, inserted, evicted)

    def _take_free(self, b: int, start: int) -> int:
        """The first free offset of bucket b at or after ``start``, wrapping around."""
        free = self._free[b]
        at = bisect.bisect_left(free, start)
        return free.pop(at if at < len(free) else 0)

    def _pass(self, keys, tids, hashes, scores, landed, inserted, failed, victims) -> None:
        """Step 4 over every key, in input order (a full bucket evicts only once the
        table cannot grow; before, the key fails)."""
        s, bc, nb = self._s, self.bucket_capacity, self.num_buckets
        for i in range(len(keys)):
            b = hashes[i] & (nb - 1)
            hit = self._index.get((tids[i], keys[i]))
            if hit is not None:
                s.scores[hit] = self._score_on_hit(s.scores[hit], i, scores)
                s.pinned[hit] = True
                landed[i] = True
                continue
            if self._free[b]:
                slot = b * bc + self._take_free(b, start_offset(hashes[i], bc))
            else:
                evicts = self.strategy != "NO_EVICTION" and nb == self.max_num_buckets
                slot = self._victim(b) if evicts else None
                if slot is None:
                    failed.append(i)
                    continue
                victims.append((i, s.keys[slot], s.tids[slot], s.scores[slot], slot, s.values[slot]))
                del self._index[(s.tids[slot], s.keys[slot])]
            s.occupied[slot], s.keys[slot], s.tids[slot], s.hashes[slot] = True, keys[i], tids[i], hashes[i]
            s.scores[slot] = self._score_on_insert(i, scores)
            s.pinned[slot] = True
            self._index[(tids[i], keys[i])] = slot
            landed[i] = inserted[i] = True

    def _victim(self, bucket: int) -> Optional[int]:
        """The unpinned slot of a full bucket with the minimum score, ties to the lowest slot."""
        s, bc = self._s, self.bucket_capacity
        best = None
        for slot in range(bucket * bc, (bucket + 1) * bc):
            if not s.pinned[slot] and (best is None or s.scores[slot] < s.scores[best]):
                best = slot
        return best


def keys_in_bucket(bucket: int, num_buckets: int, count: int, table_id: int = 0, start: int = 0) -> List[int]:
    """The first ``count`` keys ``>= start`` whose hash falls in ``bucket`` of ``num_buckets``."""
    out = []
    k = start
    while len(out) < count:
        if ref_hash(table_id, k) & (num_buckets - 1) == bucket:
            out.append(k)
        k += 1
    return out
