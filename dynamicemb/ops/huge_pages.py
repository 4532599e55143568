"""CPU tensors on transparent huge pages (Linux ``MADV_HUGEPAGE`` on fresh 2 MiB-aligned
memory) where the OS grants them: a hash table's random probes then miss the TLB far
less. ``DYNAMICEMB_HUGE_PAGES=0`` turns the request off."""

import ctypes
import os
import sys
from typing import Optional, Sequence, Union

import torch

__all__ = ["empty", "zeros"]

_MADV_HUGEPAGE = 14  # Linux
_HUGE_PAGE = 2 << 20
# Smaller arrays hold no whole huge page.
_MIN_BYTES = _HUGE_PAGE

_madvise = None


def _madvise_function():
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def _wanted(nbytes: int, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and sys.platform.startswith("linux")
        and nbytes >= _MIN_BYTES
        and os.environ.get("DYNAMICEMB_HUGE_PAGES", "1") != "0"
    )


def empty(shape: Union[int, Sequence[int]], dtype: torch.dtype,
          device: Optional[torch.device] = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, contiguous and uninitialized, on
    huge pages where possible (CPU tensors only): its first writer faults them in."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise_function() if _wanted(nbytes, device) else None
    if not madvise:
        return torch.empty(shape, dtype=dtype, device=device)
    # One huge page more than needed, so that the tensor can start on a huge page
    # boundary and every page of it can be a huge one.
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8, device=device)
    start = (raw.data_ptr() + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    madvise(start, (nbytes + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE,
            _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    skip = start - raw.data_ptr()
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def zeros(shape: Union[int, Sequence[int]], dtype: torch.dtype,
          device: Optional[torch.device] = None) -> torch.Tensor:
    """``torch.zeros``, on huge pages where possible (see ``empty``)."""
    return empty(shape, dtype, device).zero_()
