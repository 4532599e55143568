"""Every kernel launch passes what the kernel's C signature takes, without a GPU.

CuPy packs each numpy scalar of a launch by its own type: a missing, extra, shifted
or mistyped argument does not fail the launch, it hands the kernel garbage, seen
only on a GPU. Here the CUDA path runs emulated (``cuda_emulation.py``) through the
verbs that launch every kernel; each launch's argument types are recorded and
compared, position by position, with the signature read from ``csrc/cuda``: a
pointer or ``uint64_t`` is a ``numpy.uint64``, ``int64_t`` a ``numpy.int64``,
``int``/``int32_t`` a ``numpy.int32``, ``bool`` a ``numpy.bool_``, ``float`` a
``numpy.float32``, ``double`` a ``numpy.float64``.
"""

import os
import re
import sys
from typing import Dict, List, Optional

import numpy as np
import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
from dynamicemb.ops.cuda import _KERNELS, cuda_source_root
from dynamicemb.ops.records import DeviceSchedule, InitRows, InitSpec, RowFormat
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.scripts import ROOT

_SCALARS = {"int64_t": np.int64, "uint64_t": np.uint64, "int": np.int32, "int32_t": np.int32,
            "bool": np.bool_, "float": np.float32, "double": np.float64}


def _sources() -> Dict[str, str]:
    folder = os.path.join(cuda_source_root(), "cuda")
    out = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            out[name] = f.read()
    return out


def _parameter_macros(sources: Dict[str, str]) -> Dict[str, str]:
    """The ``#define DEMB_*_PARAMS`` lists of csrc/cuda, continuation lines joined."""
    macros = {}
    for text in sources.values():
        for m in re.finditer(r"#define (DEMB_\w+_PARAMS)\s+((?:.*\\\n)*.*)", text):
            macros[m.group(1)] = m.group(2).replace("\\\n", " ")
    return macros


def signature(name: str, sources: Dict[str, str], macros: Dict[str, str]) -> List[type]:
    """The numpy type of each parameter of kernel ``name``."""
    text = sources[_KERNELS[name]]
    head = f'extern "C" __global__ void {name}('
    start = text.index(head) + len(head)
    params = text[start:text.index(")", start)]
    for macro, body in macros.items():
        params = params.replace(macro, body)
    types = []
    for param in params.split(","):
        words = param.replace("*", " * ").split()
        if "*" in words:
            types.append(np.uint64)
            continue
        c_type = " ".join(w for w in words[:-1] if w != "const")
        assert c_type in _SCALARS, f"{name}: parameter {param.strip()!r}"
        types.append(_SCALARS[c_type])
    return types


def _launch_every_kernel() -> None:
    """``benchmark/gpu_kernel_sweep.py``'s sweep, the calls that launch every kernel
    (the GPU run's memcheck stage runs the same), on the emulated device."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark"))
    try:
        from gpu_kernel_sweep import sweep  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    sweep(torch.device("cpu"))


def mismatch(name: str, got: tuple, want: List[type]) -> Optional[str]:
    """Why the argument types ``got`` of a launch of ``name`` do not fit ``want``, or
    None when they do."""
    if len(got) != len(want):
        return f"{name}: {len(got)} arguments, takes {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g is not w:
            return f"{name}: argument {i} is {g.__name__}, the kernel takes {w.__name__}"
    return None


def test_every_launch_matches_its_kernel_signature():
    sources = _sources()
    macros = _parameter_macros(sources)
    with emulated_cuda() as kernels:
        _launch_every_kernel()
    assert set(kernels.argument_types) == set(_KERNELS), \
        f"not launched: {sorted(set(_KERNELS) - set(kernels.argument_types))}"
    for name, launches in sorted(kernels.argument_types.items()):
        want = signature(name, sources, macros)
        for got in launches:
            assert mismatch(name, got, want) is None, mismatch(name, got, want)


# The kernels that read or write stored rows: what a 16-bit row format changes.
ROW_KERNELS = {"demb_init_rows", "demb_pooled_forward", "demb_sequence_forward",
               "demb_per_sample_weight_grad", "demb_fused_update"}


def _launch_row_kernels_on_16_bit_rows(kernels, fmt: RowFormat) -> None:
    """Each verb of ``ROW_KERNELS`` over 4 bfloat16 rows of one table (``kernels``: the
    emulation's ``CudaKernels``), a 16-bit update rounding stochastically."""
    dim, words = fmt.dim, fmt.row_bytes // 4
    values, host = torch.zeros(8, words), torch.zeros(0, words)
    keys, tids = torch.arange(4), torch.zeros(4, dtype=torch.int16)
    spec = InitSpec(torch.tensor([[5, 2, 11]]), torch.tensor([[0.0, 1.0, -1.0, 1.0, 0.0]]))
    row_format = (fmt.code, fmt.state_offset)
    kernels.init_rows(values, torch.arange(4), None, keys, tids, dim, spec, 0.0,
                      row_format=row_format)
    tiers, transient, row_ref = [values, host], torch.zeros(0, dim), torch.tensor([0, 1, 2, -1])
    inverse, offsets, feature_col = torch.arange(4), torch.tensor([0, 2, 4]), torch.tensor([0])
    init = InitRows(keys, tids, spec)
    kernels.pooled_forward(tiers, transient, row_ref, inverse, offsets, None, feature_col, 2,
                           dim, False, torch.zeros(2, dim), init=init, row_format=row_format)
    kernels.sequence_forward(tiers, transient, row_ref, inverse, dim, torch.zeros(4, dim),
                             init=init, row_format=row_format)
    grad = torch.ones(2, dim)
    kernels.per_sample_weight_grad(tiers, transient, row_ref, inverse, offsets, feature_col, 2,
                                   dim, grad, torch.zeros(4), init=init, row_format=row_format)
    schedule = DeviceSchedule(torch.tensor([0.1], dtype=torch.float64),
                              torch.zeros(1, dtype=torch.int64), True, 0.9, 0.999, 0.0)
    rounding = (keys, tids, torch.tensor([[5, 1]]), schedule.step, True)
    kernels.fused_backward(tiers, row_ref, torch.arange(5), torch.arange(4), offsets, None,
                           feature_col, 2, dim, False, grad, 3, 0.1, 1e-8, 0.9, 0.999, 0.0,
                           0.1, 1.0, 1.0, schedule=schedule, row_format=row_format,
                           rounding=rounding)


def test_16_bit_row_launches_match_their_kernel_signatures():
    """A 16-bit row format reaches the row kernels as (row_dtype int, state_offset
    int64), and a 16-bit update its rounding's four pointers and flag: each launch fits
    its signature, and carries the format and the rounding (no null pointer)."""
    sources = _sources()
    macros = _parameter_macros(sources)
    fmt = RowFormat(torch.bfloat16, dim=7, state_dim=1)  # an odd dim: padding before state
    given = {}
    with emulated_cuda() as kernels:
        launch = kernels._launch

        def recorded(name, device, threads, args, *rest, **kw):
            given[name] = list(args)
            return launch(name, device, threads, args, *rest, **kw)

        kernels._launch = recorded
        _launch_row_kernels_on_16_bit_rows(kernels, fmt)
    assert ROW_KERNELS <= set(given)
    for name in ROW_KERNELS:
        want = signature(name, sources, macros)
        got = tuple(type(x) for x in given[name])
        assert mismatch(name, got, want) is None, mismatch(name, got, want)
        # DEMB_ROW_PARAMS and demb_fused_update: (rows, rows, width, row_dtype,
        # state_offset); demb_init_rows: (values, width, row_dtype, state_offset)
        first = 2 if name == "demb_init_rows" else 3
        assert given[name][first:first + 2] == [fmt.code, fmt.state_offset], name
    *pointers, stochastic = given["demb_fused_update"][-5:]
    assert all(isinstance(x, np.uint64) and int(x) for x in pointers) and stochastic


def test_a_shifted_or_mistyped_argument_is_caught():
    """The comparison is not blind: what a step passes to demb_upsert fits its
    signature, and fails it with one parameter dropped or one type changed."""
    sources = _sources()
    macros = _parameter_macros(sources)
    want = signature("demb_upsert", sources, macros)
    with emulated_cuda() as kernels:
        module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=8, max_capacity=256)])
        module(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]))
    (got,) = kernels.argument_types["demb_upsert"]
    assert mismatch("demb_upsert", got, want) is None
    assert "arguments, takes" in mismatch("demb_upsert", got, want[:-2] + want[-1:])
    m = want.index(np.int64, 8)  # the pass's key count, after the table's parameters
    mistyped = want[:m] + [np.int32] + want[m + 1:]
    assert f"argument {m} is int64" in mismatch("demb_upsert", got, mistyped)


def test_the_emulation_holds_no_tensor_of_a_finished_launch():
    """The emulation maps a launch's pointers back to tensors only until the launch
    has run (a GPU keeps no such map): after launches of every kernel it holds none,
    so a long test's memory does not grow with its launches."""
    with emulated_cuda() as kernels:
        _launch_every_kernel()
    assert set(kernels.launches) == set(_KERNELS)
    held = list(kernels._tensors.values()) + list(kernels._launched.values())
    assert not held, f"{len(held)} tensors held after the launches"
    assert kernels._probed is None and kernels._placed is None
