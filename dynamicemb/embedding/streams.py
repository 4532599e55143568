"""The order of a module's work across CUDA streams: TorchRec's prefetch pipelines enqueue
``prefetch(i + 1)`` on a side stream between ``forward(i)`` and ``backward(i)`` on the
training stream, all three using the same rows, so each use waits for the stream that used
them last (when another); the dense layers' work still overlaps a prefetch."""

from typing import Any, Iterator, Optional

import torch

from dynamicemb.ops.streams import streams_for

__all__ = ["StreamOrder", "tensors_in"]


class StreamOrder:
    """Orders each use of the tables after their last use on another stream (CUDA only;
    ``streams``: the ``dynamicemb.ops.streams`` API, given by tests)."""

    def __init__(self, device: torch.device, streams: Optional[Any] = None) -> None:
        self.streams = streams if streams is not None else streams_for(device)
        self.device = device
        self._last = None

    def before_use(self) -> None:
        """The current stream waits for the stream that last used the rows, if another
        (called before a forward's lookup, a backward's update and a prefetch)."""
        if self.streams is None or self._last is None:
            return
        current = self.streams.current_stream(self.device)
        if current != self._last and not self._capturing():
            current.wait_stream(self._last)

    def _capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (which cannot wait on work
        outside it: the caller orders its replays)."""
        return bool(self.streams.is_current_stream_capturing())

    def hand_over(self, *records) -> None:
        """``record_stream`` of the tensors of ``records`` (a prefetch's lookups) on the
        current stream: their memory, once freed, waits for this stream's work so far."""
        if self.streams is None:
            return
        current = self.streams.current_stream(self.device)
        for t in tensors_in(records):
            self.streams.record_stream(t, current)

    def used(self) -> None:
        """The current stream has just enqueued work that reads or writes the rows."""
        if self.streams is not None:
            self._last = self.streams.current_stream(self.device)


def tensors_in(record) -> Iterator[torch.Tensor]:
    """Every tensor of a record: a tensor, or tuples, lists and dicts of records."""
    if isinstance(record, torch.Tensor):
        yield record
    elif isinstance(record, (tuple, list)):
        for item in record:
            yield from tensors_in(item)
    elif isinstance(record, dict):
        for item in record.values():
            yield from tensors_in(item)
