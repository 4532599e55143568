"""16-bit rows: ``RowFormat`` (``dynamicemb/ops/records.py``) and the rounding contract of
``csrc/dynamicemb/rounding_primitives.h``.

``rounding_check.cpp`` runs the header on its own (no torch; it also self-checks
properties that need no reference); its results are compared here with torch's
conversions, with the Python reference (``dynamicemb_testing/rounding_reference.py``,
which reference models use) and with known answers written down once.
"""

import math
import pathlib
import shutil
import subprocess

import pytest
import torch

from dynamicemb.ops.interface import RowFormat
from dynamicemb_testing import rounding_reference as ref

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = pathlib.Path(__file__).with_name("rounding_check.cpp")
COMPILER = shutil.which("g++")
HALVES = (torch.float16, torch.bfloat16)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

pytestmark = pytest.mark.skipif(COMPILER is None, reason="g++ is needed to build the C++ check "
                                                          "of rounding_primitives.h")


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """Runs ``rounding_check`` with its arguments; returns its stdout."""
    folder = tmp_path_factory.mktemp("rounding")
    exe = folder / "rounding_check"
    build = subprocess.run([COMPILER, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror",
                            f"-I{ROOT / 'csrc'}", str(SOURCE), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]

    def run(*args):
        done = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout
    return run


def _u16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def _floats(bits) -> torch.Tensor:
    """float32 values with the given uint32 bits."""
    b = torch.as_tensor(bits, dtype=torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


# float32 bits of the edges: zeros, float32 subnormals, float16 and bfloat16 subnormals,
# ties (to even up and down), largest finite values, overflow, inf, NaNs with payloads
EDGES = [
    0x00000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF,
    0x33800000, 0x33000000, 0x33000001, 0x33C00000, 0x34000000,  # 2^-24, 2^-25 (tie), 1.5*2^-24
    0x387FC000, 0x387FE000, 0x387FF000, 0x38800000,  # around float16's smallest normal
    0x3F801000, 0x3F803000, 0x3F801001, 0x3F800FFF,  # float16 ties at 1
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # bfloat16 ties at 1
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x4B800000,  # float16 max
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7EFFFF, 0x7F7E8000,  # bfloat16 max
    0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x7F802000,
]
EDGES += [b | 0x80000000 for b in EDGES]


def _inputs() -> torch.Tensor:
    """float32 bits of about 1M values: uniform bit patterns, exponents around float16's
    range, exact ties of both formats (normal and subnormal float16), and the edges."""
    g = torch.Generator().manual_seed(54)
    n = 1 << 18
    patterns = torch.randint(0, 2**32, (n,), generator=g)
    sign = torch.randint(0, 2, (2 * n,), generator=g) << 31
    exp = torch.randint(90, 161, (2 * n,), generator=g)
    near = sign | (exp << 23) | torch.randint(0, 2**23, (2 * n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g) << 31
    exp = torch.randint(95, 146, (n,), generator=g)
    mant = torch.randint(0, 2**23, (n,), generator=g)
    drop = (13 + (113 - exp).clamp(min=0)).clamp(max=23)  # float16's dropped bits
    f16_tie = sign | (exp << 23) | (mant >> drop << drop) | (torch.ones_like(drop) << (drop - 1))
    bf16_tie = sign | (exp << 23) | (mant & ~0xFFFF) | 0x8000
    ties = torch.where(torch.arange(n) % 2 == 0, f16_tie, bf16_tie)
    return torch.cat([torch.tensor(EDGES), patterns, near, ties])


@pytest.fixture(scope="module")
def values():
    return _floats(_inputs())


def _narrow(check, tmp_path, x: torch.Tensor, r16: torch.Tensor):
    """The C++ narrow_rn and narrow_sr of float32 ``x`` with bits ``r16``, each (n,) int64
    uint16 bits: (rn f16, rn bf16, sr f16, sr bf16)."""
    x_file, r_file, out = tmp_path / "x.bin", tmp_path / "r.bin", tmp_path / "out.bin"
    x_file.write_bytes(x.contiguous().numpy().tobytes())
    r_file.write_bytes(r16.to(torch.int32).contiguous().numpy().tobytes())
    check("narrow", x_file, r_file, out)
    got = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.int16).to(torch.int64)
    return (got & 0xFFFF).view(4, -1).unbind(0)


def _bits(check, tmp_path, rows):
    """The C++ (rounding_word, rounding_bits) of (seed, stream, key, step, col) rows."""
    in_file, out = tmp_path / "in.bin", tmp_path / "bits.bin"
    table = torch.tensor([[ref._i64(v) for v in r] for r in rows], dtype=torch.int64)
    in_file.write_bytes(table.numpy().tobytes())
    check("bits", in_file, out)
    got = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.int64).view(-1, 2)
    return got[:, 0], got[:, 1]


# ------------------------------------------------------------------------- the header
def test_header_self_checks(check):
    """Round trips of every 16-bit value, SR landing on a neighbour, bits in range."""
    out = check("self")
    assert out.strip().endswith(" 0 wrong"), out[-2000:]


def test_header_needs_no_library_header(tmp_path):
    """The header compiles as NVRTC sees the shared headers (``__CUDACC_RTC__``: no
    system include path, the math functions the headers use declared as NVRTC has them)."""
    prelude = tmp_path / "nvrtc_prelude.h"
    prelude.write_text('extern "C" { float sqrtf(float); float logf(float); float cosf(float);\n'
                       "float fmaf(float, float, float); float fminf(float, float);\n"
                       "float fmaxf(float, float); }\n")
    done = subprocess.run(
        [COMPILER, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Wshadow", "-Werror",
         "-nostdinc", "-nostdinc++", "-D__CUDACC_RTC__", "-D__host__=", "-D__device__=",
         "-D__forceinline__=inline", "-include", str(prelude), f"-I{ROOT / 'csrc'}", "-x", "c++",
         "-"], input='#include "dynamicemb/rounding_primitives.h"\n', capture_output=True,
        text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_widen_equals_torch_on_every_value(check, tmp_path):
    check("widen", tmp_path / "widen.bin")
    got = torch.frombuffer(bytearray((tmp_path / "widen.bin").read_bytes()), dtype=torch.int32)
    got = got.to(torch.int64).view(2, 65536) & 0xFFFFFFFF
    every = torch.arange(65536, dtype=torch.int64)
    every = torch.where(every >= 2**15, every - 2**16, every).to(torch.int16)
    for row, dtype in zip(got, HALVES):
        assert torch.equal(row, _f32_bits(every.view(dtype).float())), dtype


def test_narrow_rn_equals_torch(check, tmp_path, values):
    """Bit for bit torch's ``.to()`` on every value but NaN, where it gives the canonical
    quiet NaN, as the reference and ``RowFormat.pack`` do."""
    rn_f16, rn_bf16, _, _ = _narrow(check, tmp_path, values, torch.zeros(len(values)))
    nan = values.isnan()
    assert int(nan.sum()) >= 10
    for got, dtype in ((rn_f16, torch.float16), (rn_bf16, torch.bfloat16)):
        torch_bits = _u16(values.to(dtype))
        assert torch.equal(got[~nan], torch_bits[~nan]), dtype
        assert bool((got[nan] == ref.CANONICAL_NAN[dtype]).all()), dtype
        assert bool(torch.isnan(values[nan].to(dtype)).all())  # torch's bits are a NaN too
        assert torch.equal(got, _u16(ref.narrow_rn(values, dtype))), dtype
        packed = RowFormat(dtype, 1, 0).pack(values[:, None])
        assert torch.equal(got, _u16(RowFormat(dtype, 1, 0).embeddings(packed).flatten())), dtype


@pytest.mark.parametrize("bits", ["random", "zero", "max", "half"])
def test_narrow_sr_equals_reference(check, tmp_path, values, bits):
    g = torch.Generator().manual_seed(7)
    r16 = {"random": torch.randint(0, 65536, values.shape, generator=g),
           "zero": torch.zeros(values.shape, dtype=torch.int64),
           "max": torch.full(values.shape, 0xFFFF),
           "half": torch.full(values.shape, 0x8000)}[bits]
    _, _, sr_f16, sr_bf16 = _narrow(check, tmp_path, values, r16)
    for got, dtype in ((sr_f16, torch.float16), (sr_bf16, torch.bfloat16)):
        expected = _u16(ref.narrow_sr(values, r16, dtype))
        wrong = (got != expected).nonzero().flatten()
        assert len(wrong) == 0, (dtype, [(hex(int(_f32_bits(values[i]))), int(r16[i]),
                                          hex(int(got[i])), hex(int(expected[i])))
                                         for i in wrong[:5]])


def test_narrow_sr_edges():
    """Known answers of the SR rule on its edges (reference; the C++ equals it above)."""
    def sr(bits, r, dtype):
        return int(_u16(ref.narrow_sr(_floats([bits]), torch.tensor([r]), dtype)))
    f16, bf16 = torch.float16, torch.bfloat16
    assert sr(0x3F801000, 0x0FFF, f16) == 0x3C00 and sr(0x3F801000, 0x1000, f16) == 0x3C01
    assert sr(0x3F801000, 0xF000, f16) == 0x3C01  # only the low 13 bits count
    assert sr(0x3F808000, 0x7FFF, bf16) == 0x3F80 and sr(0x3F808000, 0x8000, bf16) == 0x3F81
    assert sr(0xBF808000, 0x8000, bf16) == 0xBF81  # magnitude rounds; sign kept
    assert sr(0x477FF000, 0x0FFF, f16) == 0x7BFF and sr(0x477FF000, 0x1000, f16) == 0x7C00
    assert sr(0x4B800000, 0, f16) == 0x7C00 and sr(0x7F7FFFFF, 0, bf16) == 0x7F7F
    assert sr(0x7F7FFFFF, 1, bf16) == 0x7F80  # past the largest: inf
    assert sr(0x33000000, 0x7FFF, f16) == 0x0000 and sr(0x33000000, 0x8000, f16) == 0x0001
    assert sr(0x387FF000, 0xFFFF, f16) == 0x0400  # up into the smallest normal
    assert sr(0x00000001, 0xFFFF, f16) == 0x0000  # below 2^-40: truncated
    assert sr(0x80000000, 0xFFFF, f16) == 0x8000 and sr(0x80000000, 0xFFFF, bf16) == 0x8000
    assert sr(0xFF800000, 0x1234, f16) == 0xFC00 and sr(0xFF800000, 0x1234, bf16) == 0xFF80
    assert sr(0xFFC00001, 0x1234, f16) == 0x7E00 and sr(0xFFC00001, 0x1234, bf16) == 0x7FC0


# ------------------------------------------------------------------- rounding bits
# (seed, stream, key, step, col) -> (rounding_word, rounding_bits), computed once from the
# recipe with Python integers
KNOWN_BITS = [
    ((0, 0, 0, 0, 0), 0x0B6E4843BB2FD368, 0x1C67),
    ((0, 0, 0, 1, 0), 0xCEA11E9A3C5BE94D, 0xC57E),
    ((0, 0, 0, 0, 1), 0x0B6E4843BB2FD368, 0x8902),
    ((1, 0, 0, 0, 0), 0x15BB757B565BCE7C, 0x013B),
    ((0, 1, 0, 0, 0), 0x737D172B83F534A8, 0x13AF),
    ((0, 0, 1, 0, 0), 0xA114B6D733070547, 0xB5B8),
    ((0, 3793906237, 12345, 7, 127), 0xEABB1AB2D0935FB4, 0x9F89),
    ((INT64_MAX, 2**32 - 1, -1, 2**40, 4095), 0xB3B4A74764E4B4D2, 0x4409),
    ((2**64 - 1, 123, INT64_MIN, 2**64 - 1, 12287), 0xDD68640D03321F0A, 0xB394),
]


def test_rounding_bits_known_answers(check, tmp_path):
    rows = [r for r, _, _ in KNOWN_BITS]
    words, bits = _bits(check, tmp_path, rows)
    assert [w & (2**64 - 1) for w in words.tolist()] == [w for _, w, _ in KNOWN_BITS]
    assert bits.tolist() == [b for _, _, b in KNOWN_BITS]
    for (seed, stream, key, step, col), word, r16 in KNOWN_BITS:
        w = ref.rounding_word(seed, stream, key, step)
        assert int(w) & (2**64 - 1) == word
        assert int(ref.rounding_bits(w, col)) == r16


def test_rounding_bits_match_reference(check, tmp_path):
    """C++ and the Python reference agree on many (seed, stream, key, step, column)."""
    g = torch.Generator().manual_seed(3)
    n = 20000
    seed = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g)
    seed[: n // 2] = torch.randint(0, 4, (n // 2,), generator=g)
    stream = torch.randint(0, 2**32, (n,), generator=g)
    key = torch.randint(INT64_MIN, INT64_MAX, (n,), generator=g)
    key[::3] = torch.randint(-5, 1000, (len(key[::3]),), generator=g)
    step = torch.randint(0, 2**20, (n,), generator=g)
    step[::7] = torch.randint(INT64_MIN, INT64_MAX, (len(step[::7]),), generator=g)
    col = torch.randint(0, 12288, (n,), generator=g)
    rows = torch.stack([seed, stream, key, step, col], 1).tolist()
    words, bits = _bits(check, tmp_path, rows)
    expected = ref.rounding_word(seed, stream, key, step)
    assert torch.equal(words, expected)
    assert torch.equal(bits, ref.rounding_bits(expected, col))
    # per row: dim columns from one word
    keys = torch.arange(-8, 8, dtype=torch.int64)
    table = ref.row_bits(5, 77, keys, 9, 64)
    assert table.shape == (16, 64) and int(table.min()) >= 0 and int(table.max()) < 65536
    assert torch.equal(table[3], ref.rounding_bits(ref.rounding_word(5, 77, -5, 9),
                                                   torch.arange(64)))


def test_rounding_bits_are_not_the_initializers():
    keys = torch.arange(1000, dtype=torch.int64)
    assert not bool((ref.rounding_word(0, 11, keys, 0) == ref.element_bits(0, 11, keys, 0)).any())
    # uniform enough: each of 16 bits set about half the time
    bits = ref.row_bits(0, 11, keys, 3, 128)
    for b in range(16):
        share = float(((bits >> b) & 1).double().mean())
        assert abs(share - 0.5) < 0.01, (b, share)


# ----------------------------------------------------------------- SR is unbiased
SR_VALUES = [0.1, -0.1, 1.0 + 2.0**-12, 3.14159265, -1e-3, 60000.3, 1e-6, -2.9e-7, 7e-8,
             1.2345e-30, 3e38, -0.3333333]


@pytest.mark.parametrize("dtype", HALVES)
def test_sr_is_unbiased(check, tmp_path, dtype):
    """Over 4096 updates (steps) of one element, the mean stored value is within 3 sigma of
    the float32 value; the draws use the header's own bits and rounding."""
    steps = 4096
    xs, rs = [], []
    for i, v in enumerate(SR_VALUES):
        rows = [(12, 3793906237, 1000 + i, s, i) for s in range(steps)]
        _, bits = _bits(check, tmp_path, rows)
        xs.append(torch.full((steps,), v, dtype=torch.float32))
        rs.append(bits)
    _, _, sr_f16, sr_bf16 = _narrow(check, tmp_path, torch.cat(xs), torch.cat(rs))
    got = sr_f16 if dtype == torch.float16 else sr_bf16
    stored = torch.where(got >= 2**15, got - 2**16, got).to(torch.int16).view(dtype).double()
    for i, v in enumerate(SR_VALUES):
        x = float(torch.tensor(v, dtype=torch.float32))
        draws = stored[i * steps:(i + 1) * steps]
        if dtype == torch.float16 and abs(x) < 2.0**-40:  # SR truncates below 2^-16 units
            assert not bool(draws.any()), v
            continue
        if math.isinf(float(draws.max())):  # beyond float16's range
            assert dtype == torch.float16 and abs(x) > 65504
            continue
        low, high = float(draws.min()), float(draws.max())
        assert low <= x <= high and len(torch.unique(draws)) <= 2, (v, low, high)
        if low == high:
            assert low == x, v
            continue
        p = (x - low) / (high - low)
        sigma = (high - low) * math.sqrt(p * (1 - p) / steps)
        assert abs(float(draws.mean()) - x) <= 3 * sigma, (v, float(draws.mean()), x, sigma)


# ---------------------------------------------------------------------- RowFormat
DIMS = (1, 3, 8, 128, 129)


def _state_dims(dim):
    return (0, 1, dim, 2 * dim)  # SGD, row-wise Adagrad, Adagrad, Adam


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
@pytest.mark.parametrize("dim", DIMS)
def test_row_format_layout(dtype, dim):
    size = 4 if dtype == torch.float32 else 2
    for state_dim in _state_dims(dim):
        fmt = RowFormat(dtype, dim, state_dim)
        assert fmt.elem_bytes == size and fmt.scale_offset == dim * size
        assert fmt.state_offset == 4 * math.ceil(dim * size / 4)
        assert fmt.row_bytes == fmt.state_offset + 4 * state_dim  # whole 4-byte words
        assert fmt.code == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
        if dtype == torch.float32:  # today's rows, byte for byte
            assert fmt.row_bytes == (dim + state_dim) * 4
            assert (fmt.storage_dtype, fmt.storage_width) == (torch.float32, dim + state_dim)
        else:  # stored as float32 words, like float32 rows
            assert (fmt.storage_dtype, fmt.storage_width) == (torch.float32, fmt.row_bytes // 4)
        name = str(dtype).split(".")[1]
        assert fmt.tag == f"{name}[{dim}]+f32[{state_dim}]"


def test_row_format_known_sizes():
    """dim 128 (the issue's measure): bfloat16 SGD 256 B, row-wise Adagrad 260 B."""
    bf16, f32 = torch.bfloat16, torch.float32
    assert [RowFormat(bf16, 128, s).row_bytes for s in (0, 1, 128, 256)] == [256, 260, 768, 1280]
    assert [RowFormat(f32, 128, s).row_bytes for s in (0, 1, 128, 256)] == [512, 516, 1024, 1536]
    assert RowFormat(torch.float16, 3, 0).row_bytes == 8  # padded to a word
    assert (RowFormat(torch.float16, 3, 1).state_offset, RowFormat(torch.float16, 3, 1).row_bytes) \
        == (8, 12)
    scaled = RowFormat(bf16, 5, 2, scale_bytes=8)  # a later 8-bit row's scale goes here
    assert (scaled.scale_offset, scaled.state_offset, scaled.row_bytes) == (10, 20, 28)
    assert scaled.tag == "bfloat16[5]+scale[8]+f32[2]"
    assert RowFormat(torch.float16, 3, 0, scale_bytes=1).row_bytes == 8


@pytest.mark.parametrize("args, match", [
    ((torch.int8, 4, 0), "dtype"), ((torch.float64, 4, 0), "dtype"),
    ((torch.float32, -1, 0), "dim"), ((torch.float32, 0, 0), "dim"),
    ((torch.float16, 4, -2), "state_dim"), ((torch.float16, 4, 0, -1), "scale_bytes"),
    ((torch.float32, 4.0, 0), "dim"), ((torch.float32, True, 0), "dim"),
    ((torch.float32, 4, 0, 4), "scale"),
])
def test_row_format_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        RowFormat(*args)


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES])
@pytest.mark.parametrize("dim", (1, 3, 128))
def test_row_format_pack_round_trip(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    for state_dim in _state_dims(dim):
        fmt = RowFormat(dtype, dim, state_dim)
        n = 33
        emb = torch.randn(n, dim, generator=g) * 10
        emb[0, 0], emb[-1, -1] = float("nan"), float("-inf")
        states = torch.rand(n, state_dim, generator=g)
        rows = fmt.pack(emb, states if state_dim else None)
        assert rows.shape == (n, fmt.storage_width) and rows.dtype == fmt.storage_dtype
        expected = emb if dtype == torch.float32 else ref.narrow_rn(emb, dtype)
        got = fmt.embeddings(rows)
        assert got.dtype == dtype and got.shape == (n, dim)
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # bits, NaN too
        assert torch.equal(fmt.states(rows), states)
        again = fmt.pack(got, fmt.states(rows) if state_dim else None)
        assert torch.equal(again.view(torch.uint8), rows.view(torch.uint8))
        # the views are the rows: writing one writes the other; padding stays zero
        fmt.embeddings(rows)[1] = 2.0
        if state_dim:
            fmt.states(rows)[1] = -1.0
            assert float(fmt.states(rows[1])[0]) == -1.0  # a single row, too
        assert bool((fmt.embeddings(rows[1]).float() == 2.0).all())
        if dtype != torch.float32:
            pad = rows.view(torch.uint8)[:, fmt.scale_offset:fmt.state_offset]
            assert not bool(pad.any())


def test_row_format_pack_and_views_refuse_wrong_shapes():
    fmt = RowFormat(torch.bfloat16, 4, 1)
    with pytest.raises(ValueError, match="embeddings"):
        fmt.pack(torch.zeros(2, 5), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="states"):
        fmt.pack(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="states"):
        fmt.pack(torch.zeros(2, 4), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="rows"):
        fmt.embeddings(torch.zeros(2, 12))  # float32, not uint8
    with pytest.raises(ValueError, match="rows"):
        fmt.states(torch.zeros(2, 13, dtype=torch.uint8))
    f32 = RowFormat(torch.float32, 4, 1)
    assert torch.equal(f32.pack(torch.ones(2, 4, dtype=torch.bfloat16), torch.zeros(2, 1)),
                       torch.tensor([[1.0] * 4 + [0.0]] * 2))  # widened exactly
