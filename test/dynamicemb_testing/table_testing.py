"""Factories and comparison helpers shared by the hash-table tests.

The real table takes tensors; the reference model takes Python lists. ``Pair`` drives both
with the same inputs and converts the real table's outputs to Python values so that they
can be compared with ``==``.
"""

from typing import List, Optional, Sequence

import pytest
import torch

from dynamicemb import DynamicEmbCheckMode, DynamicEmbScoreStrategy, ScoredHashTable
from dynamicemb_testing.reference_table import ReferenceHashTable

STRATEGIES = ["LRU", "STEP", "LFU", "CUSTOMIZED", "NO_EVICTION"]
CHECK_MODES = ["ERROR", "WARNING", "IGNORE"]
VALUE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
STAT_FIELDS = ("inserts", "evictions", "failed_inserts", "erases", "growths")


def table_kwargs(**kw) -> dict:
    """Constructor arguments with the enums filled in from names."""
    kw = dict(kw)
    for name, enum in (("score_strategy", DynamicEmbScoreStrategy), ("check_mode", DynamicEmbCheckMode)):
        if name in kw and not isinstance(kw[name], enum):
            kw[name] = enum[kw[name]]
    return kw


def make_table(**kw) -> ScoredHashTable:
    """``ScoredHashTable(**kw)`` (``device=`` included); enums may be given by name."""
    return ScoredHashTable(**table_kwargs(**kw))


def as_keys(keys: Sequence[int], device="cpu") -> torch.Tensor:
    return torch.tensor(list(keys), dtype=torch.int64, device=device)


def as_values(rows: Sequence[Sequence[float]], n: int, dim: int, dtype: torch.dtype,
              device="cpu") -> torch.Tensor:
    return torch.tensor([list(r) for r in rows], dtype=dtype, device=device).reshape(n, dim)


def rows_of(t: torch.Tensor) -> List[tuple]:
    """Rows of a (m, dim) tensor as tuples of Python floats (exact for every float dtype)."""
    return [tuple(r) for r in t.to(torch.float64).tolist()] if t.shape[1] else [()] * t.shape[0]


def py_export(ex) -> tuple:
    return (ex.keys.tolist(), ex.table_ids.tolist(), ex.scores.tolist(), ex.slots.tolist(), rows_of(ex.values))


def py_insert(res) -> tuple:
    ev = None if res.evicted is None else py_export(res.evicted)
    return res.slots.tolist(), res.inserted.tolist(), ev


def ref_insert(res) -> tuple:
    ev = None if res.evicted is None else tuple(res.evicted)
    return res.slots, res.inserted, ev


def py_stats(stats) -> dict:
    return {f: int(getattr(stats, f)) for f in STAT_FIELDS}


def export_map(ex: tuple) -> dict:
    """(tid, key) -> (score, value row) of a ``py_export``/``RefExported`` tuple."""
    keys, tids, scores, _slots, values = ex
    return {(t, k): (s, v) for k, t, s, v in zip(keys, tids, scores, values)}


def state_of(real) -> dict:
    """Everything observable about a real table (for "unchanged" and model comparisons)."""
    return {
        "export": py_export(real.export_batch()),
        "size": real.size(),
        "capacity": real.capacity(),
        "clock": real.clock,
        "stats": py_stats(real.stats),
    }


def ref_state_of(ref: ReferenceHashTable) -> dict:
    return {
        "export": tuple(ref.export_batch()),
        "size": ref.size(),
        "capacity": ref.capacity(),
        "clock": ref.clock,
        "stats": py_stats(ref.stats),
    }


class Pair:
    """A real table (on ``device``) and its reference model, driven with the same calls."""

    def __init__(self, value_dtype: torch.dtype = torch.float32, device="cpu", **kw):
        self.dtype = value_dtype
        self.device = torch.device(device)
        self.real = make_table(value_dtype=value_dtype, device=self.device, **kw)
        self.ref = ReferenceHashTable(**kw)
        self.dim = self.ref.value_dim
        self.last_error = None

    def rows(self, rows: Optional[Sequence[Sequence[float]]], n: int):
        """(tensor, model rows): the model sees the values rounded to ``value_dtype``."""
        if rows is None:
            return None, None
        t = as_values(rows, n, self.dim, self.dtype, self.device)
        return t, rows_of(t)

    def call(self, verb: str, keys: Sequence[int], tids=None, rows=None, scores=None):
        """Runs ``verb`` on both; returns (real output as Python, model output, error types)."""
        n = len(keys)
        kt = as_keys(keys, self.device)
        tt = None if tids is None else torch.tensor(list(tids), dtype=torch.int64, device=self.device)
        st = None if scores is None else torch.tensor(list(scores), dtype=torch.int64, device=self.device)
        args, ref_args = (kt,), (list(keys),)
        if verb in ("insert_or_assign", "insert_and_evict"):
            vt, vr = self.rows(rows, n)
            args, ref_args = (kt, vt), (list(keys), vr)
        kwargs, ref_kwargs = {"table_ids": tt}, {"table_ids": None if tids is None else list(tids)}
        if verb not in ("find", "erase"):
            kwargs["scores"], ref_kwargs["scores"] = st, None if scores is None else list(scores)
        real_out = real_err = ref_out = ref_err = None
        try:
            real_out = getattr(self.real, verb)(*args, **kwargs)
        except Exception as e:  # compared with the model's below
            real_err = e
        try:
            ref_out = getattr(self.ref, verb)(*ref_args, **ref_kwargs)
        except Exception as e:
            ref_err = e
        if real_out is not None:
            real_out = py_insert(real_out) if verb not in ("find", "erase") else real_out.tolist()
        if ref_out is not None and verb not in ("find", "erase"):
            ref_out = ref_insert(ref_out)
        return real_out, ref_out, real_err, ref_err

    def check(self, verb: str, *a, **kw):
        """Runs ``verb`` on both and asserts equal outputs (or the same error type)."""
        real_out, ref_out, real_err, ref_err = self.call(verb, *a, **kw)
        assert type(real_err) is type(ref_err), (verb, real_err, ref_err)
        self.last_error = real_err
        assert real_out == ref_out, verb
        return real_out

    def assert_same_state(self):
        real, ref = state_of(self.real), ref_state_of(self.ref)
        for field in ("capacity", "size", "clock", "stats", "export"):
            assert real[field] == ref[field], field
        assert self.real.load_factor() == pytest.approx(self.ref.load_factor())
        assert self.real.num_buckets == self.ref.num_buckets

