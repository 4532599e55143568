"""The stream API the layers above use: ``torch.cuda``'s streams on a GPU, none on a CPU.
Tests pass an object of the same shape (these three methods; streams that have
``wait_stream``) to check the order of streams on a CPU."""

from typing import Optional

import torch

__all__ = ["CudaStreams", "streams_for"]


class CudaStreams:
    """``torch.cuda``'s streams."""

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """``tensor``'s memory is not reused before ``stream``'s work enqueued by then."""
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


def streams_for(device: torch.device) -> Optional[CudaStreams]:
    """The stream API of ``device``: ``CudaStreams`` for a CUDA device, else None."""
    return CudaStreams() if device.type == "cuda" else None
