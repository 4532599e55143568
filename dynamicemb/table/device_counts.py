"""Values that kernels change in device memory and the host reads only when asked (a
sync), so that a step need not wait for the device and a CUDA graph can replay it."""

from typing import Any, Dict, List, Optional

import torch

from dynamicemb.ops.streams import streams_for

__all__ = ["CountsCopy", "DeviceCounters", "DeviceTotals", "capturing"]


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Advancers:
    """The streams whose kernels were handed a device value since the host last read it;
    a host read or write on another stream first waits for them."""

    def __init__(self, device: torch.device, streams: Optional[Any] = None) -> None:
        self._api = streams if streams is not None else streams_for(device)
        self._device = device
        self._streams: list = []

    def handed(self) -> None:
        """The current stream's kernels may advance the value."""
        if self._api is not None:
            current = self._api.current_stream(self._device)
            if current not in self._streams:
                self._streams.append(current)

    def settle(self) -> None:
        """Before the host reads or writes the value: the current stream waits for the others
        that advanced it (not while a graph is captured: a capture cannot wait outside it)."""
        if self._api is None or not self._streams or self._api.is_current_stream_capturing():
            return
        current = self._api.current_stream(self._device)
        for stream in self._streams:
            if stream != current:
                current.wait_stream(stream)
        self._streams = []


class DeviceTotals:
    """Counts that kernels add to, in one (``width``,) int64 tensor; each reader ``take``s
    what was added since it last took. ``streams``: the stream API (tests give one)."""

    def __init__(self, width: int, device: torch.device, streams: Optional[Any] = None) -> None:
        self._tensor = torch.zeros(width, dtype=torch.int64, device=device)
        self._taken: Dict[str, List[int]] = {}
        self._advancers = _Advancers(device, streams)

    @property
    def tensor(self) -> torch.Tensor:
        """The totals, for kernels of the current stream that add to them."""
        self._advancers.handed()
        return self._tensor

    def take(self, reader: str) -> List[int]:
        """What was added since ``reader`` last took (reads the device: a sync)."""
        self._advancers.settle()
        now = self._tensor.tolist()
        before = self._taken.get(reader, [0] * len(now))
        self._taken[reader] = now
        return [a - b for a, b in zip(now, before)]


class DeviceCounters:
    """int64 counters (a clock, a step count) that the host sets and kernels advance: the
    host's values hold until ``on_device`` hands the device copy to kernels (a ``fill_``
    each, no sync), then the device's (a sync to read) until the host sets them again."""

    def __init__(self, values: List[int], device: torch.device,
                 streams: Optional[Any] = None) -> None:
        self._values = [int(v) for v in values]
        self._device = device
        self._tensor = None
        self._advancers = _Advancers(device, streams)
        # _HOST: the host's values hold (the device copy is written when handed out);
        # _DEVICE: kernels hold them (and may have advanced them since any read)
        self._state = _HOST

    def _read(self) -> None:
        """The device's values into the host's, when kernels hold them (a sync)."""
        if self._state == _DEVICE:
            self._advancers.settle()
            self._values = self._tensor.tolist()

    def values(self) -> List[int]:
        """The counters, read from the device when kernels hold them."""
        self._read()
        return list(self._values)

    def value(self, index: int) -> int:
        """One counter (``values()[index]``, without the copy)."""
        self._read()
        return self._values[index]

    def held_on_host(self) -> bool:
        """Whether the host's values hold (reading them costs nothing)."""
        return self._state == _HOST

    def set(self, index: int, value: int) -> None:
        """Sets one counter on the host (written to the device when next needed)."""
        self._read()
        self._values[index] = value
        self._state = _HOST

    def on_device(self) -> torch.Tensor:
        """The device copy, for kernels that read and advance it. RuntimeError if the host set
        the counters and a CUDA graph is being captured (its replays would set them back)."""
        if self._tensor is None:
            self._tensor = torch.zeros(len(self._values), dtype=torch.int64, device=self._device)
        if self._state == _HOST:
            if capturing():
                raise RuntimeError(
                    "a clock or step count was set on the host since the last step: run one "
                    "step outside the CUDA graph capture first (the capture would replay "
                    "the write)")
            self._advancers.settle()  # after the kernels of other streams that had it
            for i, v in enumerate(self._values):
                self._tensor[i].fill_(v)  # a kernel argument: no host-to-device copy
        self._state = _DEVICE
        self._advancers.handed()
        return self._tensor


_HOST, _DEVICE = 0, 1


class CountsCopy:
    """Device counts copied to host memory without waiting: ``start`` enqueues the copy
    (pinned memory and an event on a GPU; done at once on a CPU), ``arrived`` returns
    the values once it completed, else None. One copy is on the way at a time."""

    def __init__(self, width: int, device: torch.device) -> None:
        self._host = torch.zeros(width, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._values = self._host.numpy()  # read as numpy: no torch op, no sync
        self._event = None
        self.on_the_way = False

    def start(self, *counts: torch.Tensor) -> None:
        """Copies ``counts`` (int64 device tensors, ``width`` values in all) in order."""
        at = 0
        for t in counts:
            self._host[at:at + t.numel()].copy_(t, non_blocking=True)
            at += t.numel()
        self._event = None
        if counts[0].is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self.on_the_way = True

    def arrived(self) -> Optional[List[int]]:
        """The copy's values once it arrived (then no longer on the way), else None."""
        if not self.on_the_way or (self._event is not None and not self._event.query()):
            return None
        self.on_the_way = False
        return [int(v) for v in self._values]

    def wait(self) -> List[int]:
        """The values of the copy on the way, waiting for it (only for it)."""
        if self._event is not None:
            self._event.synchronize()
        self.on_the_way = False
        return [int(v) for v in self._values]
