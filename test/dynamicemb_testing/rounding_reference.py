"""The rounding contract of ``csrc/dynamicemb/rounding_primitives.h`` in torch integer ops:
what a 16-bit row's update must store, for reference models and the kernels' tests.

Words are int64 tensors read as uint64 (products wrap, shifts are logical); 16- and
32-bit values are int64 tensors in range. The header documents the recipe; this file
follows it line by line and imports nothing of ``dynamicemb``.
"""

import torch

GOLDEN = 0x9E3779B97F4A7C15
#: element_bits' counter multiplier (init_primitives.h)
COUNTER_MULTIPLIER = 0xD1B54A32D192ED03
#: "SR": XORed into the step, so rounding words are not the initializer's
ROUNDING_DOMAIN = 0x5352 << 48
#: every NaN rounds to nearest as this quiet NaN
CANONICAL_NAN = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}

_M32 = 0xFFFFFFFF


def _i64(value: int) -> int:
    """A uint64 constant as the int64 with its bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _word(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64)
    return torch.tensor(_i64(int(x)), dtype=torch.int64)


def hash_key(keys, table) -> torch.Tensor:
    """The table's hash (hash_primitives.h ``hash_key``): splitmix64's finalizer of
    ``key + (table + 1) * GOLDEN``; int64 tensors or ints, broadcast."""
    x = _word(keys) + (_word(table) + 1) * _i64(GOLDEN)
    x = (x ^ _shr(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _i64(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def element_bits(seed, stream, keys, counter) -> torch.Tensor:
    """init_primitives.h ``element_bits``: two rounds of the table hash."""
    row = hash_key(keys, stream) ^ (_word(seed) * _i64(GOLDEN))
    return hash_key(row ^ (_word(counter) * _i64(COUNTER_MULTIPLIER)), 0)


def rounding_word(seed, stream, keys, step) -> torch.Tensor:
    """One row's 64 rounding bits for an update at ``step`` (int64, read as uint64)."""
    return element_bits(seed, stream, keys, _word(step) ^ _i64(ROUNDING_DOMAIN))


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 of uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def rounding_bits(word: torch.Tensor, cols) -> torch.Tensor:
    """16 random bits of column ``cols`` of the row of ``word`` (broadcast), in [0, 65536)."""
    c = (_word(cols) & _M32) * 0x9E3779B9 & _M32
    return lowbias32((word & _M32) ^ _shr(word, 32) ^ c) & 0xFFFF


def row_bits(seed: int, stream: int, keys: torch.Tensor, step, dim: int) -> torch.Tensor:
    """(n, dim) int64 rounding bits of the rows of (n,) int64 ``keys`` of one table at
    ``step`` (an int or (n,) int64)."""
    word = rounding_word(seed, stream, keys, step)
    return rounding_bits(word[:, None], torch.arange(dim, dtype=torch.int64)[None, :])


def narrow_rn(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest even: torch's ``.to(dtype)`` of the float32 values, with every NaN
    the canonical one."""
    wide = x.to(torch.float32)
    out = wide.to(dtype)
    out.view(torch.int16).masked_fill_(wide.isnan(), CANONICAL_NAN[dtype])
    return out


def narrow_sr(x: torch.Tensor, r16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stochastic rounding of float32 ``x`` with 16 random bits ``r16`` per element
    (broadcast), in integer ops as the header does it."""
    u = x.to(torch.float32).view(torch.int32).to(torch.int64) & _M32
    r = r16.to(torch.int64) & 0xFFFF
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    rn = narrow_rn(x, dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    if dtype == torch.bfloat16:
        h = sign | ((a + r) >> 16)
    elif dtype == torch.float16:
        normal = sign | (((a + (r & 0x1FFF)) >> 13) - (112 << 10)).clamp(max=0x7C00)
        exp = a >> 23
        mant = torch.where(exp > 0, (a & 0x7FFFFF) | 0x800000, a & 0x7FFFFF)
        shift = torch.where(exp > 0, exp, 1) - 110  # units of 2^-24, 16 fraction bits
        q = torch.where(shift >= 0, mant << shift.clamp(0, 2), mant >> (-shift).clamp(0, 63))
        h = torch.where(a >= 0x38800000, normal, sign | ((q + r) >> 16))
    else:
        raise ValueError(f"no 16-bit format {dtype}")
    h = torch.where(a >= 0x7F800000, rn, h)
    return torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(dtype)


def stochastic_round(rows: torch.Tensor, keys: torch.Tensor, seed: int, stream: int, step,
                     dtype: torch.dtype) -> torch.Tensor:
    """(n, dim) float32 ``rows`` of (n,) int64 ``keys`` of one table, written back at
    ``step`` with stochastic rounding: what an update stores."""
    return narrow_sr(rows, row_bits(seed, stream, keys, step, rows.shape[1]), dtype)
