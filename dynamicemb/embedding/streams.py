"""The order of a module's work across CUDA streams.

TorchRec's prefetch pipelines run ``prefetch(i + 1)`` on a side stream after the
host has enqueued ``forward(i)`` on the training stream, and enqueue ``backward(i)``
on the training stream after the prefetch. Each of them reads and writes the same
hash table and rows: a prefetch evicts, writes back and reuses slots that
``forward(i)``'s lookup may not have read yet, and ``backward(i)`` looks its rows
up again (when a prefetch moved them) and updates them while the prefetch may
still be inserting. So each use of the tables first waits for the work already
enqueued on the stream that used them last, when that is another stream; uses on
one stream are ordered by the stream itself. (The training stream waiting for a
prefetch before ``forward(i + 1)`` is also the pipeline's: ``forward_stream`` in the
sharded kernels.) What still overlaps a prefetch is everything else enqueued on the
training stream meanwhile: the dense layers' forward and backward.
"""

from typing import Any, Iterator, Optional

import torch

from dynamicemb.ops.streams import streams_for

__all__ = ["StreamOrder", "tensors_in"]


class StreamOrder:
    """Orders each use of the tables after their last use on another stream.

    Args:
        device: the tables' device; only CUDA devices have streams to order.
        streams: the stream API (``dynamicemb.ops.streams``); given by tests.
    """

    def __init__(self, device: torch.device, streams: Optional[Any] = None) -> None:
        self.streams = streams if streams is not None else streams_for(device)
        self.device = device
        self._last = None

    def before_use(self) -> None:
        """The current stream waits for everything enqueued so far on the stream that
        last used the rows, when that is another stream (called before a forward's
        lookup, a backward's update and a prefetch)."""
        if self.streams is None or self._last is None:
            return
        current = self.streams.current_stream(self.device)
        if current != self._last and not self._capturing():
            current.wait_stream(self._last)

    def _capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph: a capture
        cannot wait for work outside it (the caller orders its graph's replays)."""
        return bool(self.streams.is_current_stream_capturing())

    def hand_over(self, *records) -> None:
        """The current stream takes over the tensors of ``records`` (a prefetch's
        lookups, made on the stream that prefetched): their memory, once freed, is
        reused only after the work the current stream has enqueued by then, not as soon
        as the stream that allocated them is done (``record_stream``)."""
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
    """Every tensor of a record: a tensor, or tuples (named ones too), lists and dicts of
    records; anything else holds none."""
    if isinstance(record, torch.Tensor):
        yield record
    elif isinstance(record, (tuple, list)):
        for item in record:
            yield from tensors_in(item)
    elif isinstance(record, dict):
        for item in record.values():
            yield from tensors_in(item)
