"""A stand-in for the stream API (``dynamicemb.ops.streams``) on a machine without a
GPU: a current stream that tests switch, and what the code asks of streams (waits,
``record_stream``), recorded."""

from typing import List, Tuple

import torch

__all__ = ["StreamRecorder"]


class StreamRecorder:
    """Streams are names; ``current`` is the current one.

    Attributes:
        waits: (waiting stream, stream waited for) of every ``wait_stream``.
        records: (tensor, stream) of every ``record_stream``.
    """

    def __init__(self, current: str = "train") -> None:
        self.current = current
        self.waits: List[Tuple[str, str]] = []
        self.records: List[Tuple[torch.Tensor, str]] = []
        recorder = self

        class Stream(str):
            def wait_stream(self, other):
                recorder.waits.append((str(self), str(other)))

        self._stream = Stream

    def current_stream(self, device=None):
        return self._stream(self.current)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.records.append((tensor, str(stream)))

    def is_current_stream_capturing(self) -> bool:
        return False

    def recorded_on(self, stream: str) -> List[torch.Tensor]:
        """The tensors recorded on ``stream``."""
        return [t for t, s in self.records if s == stream]
