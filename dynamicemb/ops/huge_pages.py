"""CPU tensors on transparent huge pages (Linux ``MADV_HUGEPAGE`` on fresh 2 MiB-aligned
memory) where the OS grants them: a hash table's random probes then miss the TLB far
less. ``DYNAMICEMB_HUGE_PAGES=0`` turns the request off.

The memory is a private anonymous mapping of its own, advised before anything touches
it: advice on heap memory that an earlier, freed allocation had already faulted in
leaves its 4 KiB pages as they are, so that whether a table got huge pages depended on
the process's allocation history (in one benchmark process the second of two equal
tables had none for its keys and scores, and its step took 10% longer)."""

import mmap
import os
import sys
import warnings
from typing import Optional, Sequence, Union

import torch

__all__ = ["empty", "zeros"]

_HUGE_PAGE = 2 << 20
# Smaller arrays hold no whole huge page.
_MIN_BYTES = _HUGE_PAGE


def _wanted(nbytes: int, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and nbytes >= _MIN_BYTES
        and os.environ.get("DYNAMICEMB_HUGE_PAGES", "1") != "0"
    )


def empty(shape: Union[int, Sequence[int]], dtype: torch.dtype,
          device: Optional[torch.device] = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, contiguous and uninitialized, on
    huge pages where possible (CPU tensors only): its first writer faults them in. The
    tensor keeps its mapping; the mapping goes with the last tensor that views it."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if not _wanted(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    # One huge page more than needed, so that the tensor can start on a huge page
    # boundary and every page of it can be a huge one.
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # writable: frombuffer's warning does not apply
        raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, skip, len(region) - skip)
    except OSError:
        pass  # advice only: a kernel without transparent huge pages refuses it
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def zeros(shape: Union[int, Sequence[int]], dtype: torch.dtype,
          device: Optional[torch.device] = None) -> torch.Tensor:
    """``torch.zeros``, on huge pages where possible (see ``empty``)."""
    return empty(shape, dtype, device).zero_()
