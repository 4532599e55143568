"""The stream API the layers above use: ``torch.cuda``'s streams on a GPU, none on a CPU.

One object with the three things the module does with streams (the current one,
``record_stream`` on a tensor, whether a graph capture is running); each stream it
returns has ``wait_stream``. Tests hand an object of the same shape to the users
(``StreamOrder``, ``DeviceCounters``, ``DeviceTotals``, the CUDA backend's growth)
to check the order of their streams on a CPU.
"""

from typing import Optional

import torch

__all__ = ["CudaStreams", "streams_for"]


class CudaStreams:
    """``torch.cuda``'s streams."""

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """The caching allocator reuses ``tensor``'s memory, once it is freed, only after
        the work ``stream`` has enqueued by then (CPU tensors: nothing to record)."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


def streams_for(device: torch.device) -> Optional[CudaStreams]:
    """The stream API of ``device``: ``CudaStreams`` for a CUDA device, else None."""
    return CudaStreams() if device.type == "cuda" else None
