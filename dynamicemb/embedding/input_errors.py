"""A module's input check on a GPU step: found by a kernel, raised by the host later.

A training step that keeps its counts on the device (``Backend.counts_on_device``)
cannot read whether a batch's offsets are well formed before going on: that read
would wait for the device. So the check is a kernel that writes the batch's
problem into an error word in device memory; every later kernel of the step reads
the word, so a refused batch reads no offsets, pools to zeros and changes no row.
The word goes to pinned host memory by an asynchronous copy, and the host reads it
at the module's next call, once an event recorded after the copy has completed
(by then it almost always has: the check is the first kernel of a step, so the
host does not wait for the step that is still running). Then the error is raised
with its message, the counters the refused batch advanced on the host go back,
and the word is cleared. ``at_once`` waits for the copy in the call itself: a host
sync per step, and the error before the call returns.
"""

from typing import Callable, NamedTuple, Optional

import torch

from dynamicemb.ops.interface import offsets_problem

__all__ = ["CheckedBatch", "InputErrors", "offsets_message"]


def offsets_message(problem: int, offsets: torch.Tensor, num_indices: int) -> str:
    """What is wrong with ``offsets`` (``Backend.check_offsets``'s code ``problem``)."""
    if problem in (1, 2):
        return (f"offsets must start at 0 and end at len(indices)={num_indices}, "
                f"got {int(offsets[0])} and {int(offsets[-1])}")
    return "offsets must be non-decreasing"


class CheckedBatch:
    """A batch whose check is on its way to the host.

    Attributes:
        refused: set once the host has read that the check failed: the batch's
            backward then does nothing.
    """

    def __init__(self, offsets: torch.Tensor, num_indices: int,
                 restore: Callable[[], None]) -> None:
        self.offsets = offsets
        self.num_indices = num_indices
        self.restore = restore
        self.refused = False


class _Pending(NamedTuple):
    batch: CheckedBatch
    event: Optional[object]  # a torch.cuda.Event recorded after the copy, or None


class InputErrors:
    """The error word of one module and the batch it was last written for.

    Args:
        device: the module's device.
        at_once: raise in the call that gets a bad batch (a sync per step).
    """

    def __init__(self, device: torch.device, at_once: bool = False) -> None:
        self.word = torch.zeros(1, dtype=torch.int64, device=device)
        self.at_once = at_once
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_value = self._host.numpy()  # read as numpy: no torch op, no sync
        self._pending: Optional[_Pending] = None

    def checked(self, batch: CheckedBatch) -> None:
        """After the check kernel of ``batch`` was enqueued: its word starts for the
        host (with ``at_once``, the error is raised now)."""
        self._host.copy_(self.word, non_blocking=True)
        event = None
        if self.word.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending = _Pending(batch, event)
        if self.at_once:
            self.raise_if_refused()

    def raise_if_refused(self) -> None:
        """Raises ``ValueError`` if the batch checked last was refused, after putting
        back the host counters it advanced; then the word is cleared. Waits only for
        the copy of that batch's word (see the module docstring)."""
        if self._pending is None:
            return
        batch, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        problem = offsets_problem(int(self._host_value[0]))
        if not problem:
            return
        batch.refused = True
        self.word.zero_()
        batch.restore()
        when = ("no table changed" if self.at_once else
                "in the batch given to the call before this one, whose output was zeros; "
                "no table changed")
        raise ValueError(f"{offsets_message(problem, batch.offsets, batch.num_indices)} "
                         f"(found on the device: {when})")
