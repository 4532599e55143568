"""The order of a module's work across CUDA streams.

TorchRec's prefetch pipelines run ``prefetch(i + 1)`` on a side stream after the
host has enqueued ``forward(i)`` on the training stream. A prefetch changes rows
(evictions, write-backs, new rows in reused slots) that ``forward(i)``'s lookup may
not have read yet: it must wait for the work already enqueued on the stream that
last used the tables. (The other direction, the training stream waiting for a
prefetch, is the pipeline's: ``forward_stream`` in the sharded kernels.)
"""

from typing import Any, Optional

import torch

__all__ = ["StreamOrder"]


class StreamOrder:
    """Orders a prefetch after the last use of the tables on another stream.

    Args:
        device: the tables' device; only CUDA devices have streams to order.
        streams: the stream API (``torch.cuda``'s ``current_stream``); given by tests.
    """

    def __init__(self, device: torch.device, streams: Optional[Any] = None) -> None:
        self.streams = streams if streams is not None else (
            torch.cuda if device.type == "cuda" else None)
        self.device = device
        self._last = None

    def used(self) -> None:
        """The current stream has just enqueued work that reads or writes the rows."""
        if self.streams is not None:
            self._last = self.streams.current_stream(self.device)

    def before_prefetch(self) -> None:
        """The current stream waits for everything enqueued so far on the stream that
        last used the rows, when that is another stream."""
        if self.streams is None or self._last is None:
            return
        current = self.streams.current_stream(self.device)
        if current != self._last:
            current.wait_stream(self._last)
