"""A module's input check on the training step: found by a kernel, raised by the host.

A training step that keeps its counts on the device cannot read whether a batch's
offsets are well formed before going on: on a GPU that read would wait for the
device. So the check is a kernel that writes the batch's
problem into an error word in device memory; every later kernel of the step reads
the word, so a refused batch reads no offsets, pools to zeros and changes no row.
The word goes to pinned host memory by an asynchronous copy, and the host reads it
at the module's next call, once an event recorded after the copy has completed
(by then it almost always has: the check is the first kernel of a step, so the
host does not wait for the step that is still running). Then the error is raised
with its message and the word is cleared (the step's counters advance in device
memory, and not for a refused batch: nothing needs putting back). ``at_once``
waits for the copy in the call itself: a host sync per step, and the error before
the call returns.

Under a CUDA graph's replays no module code runs: the word stays set once a batch
is refused, so every later replay changes nothing either, until the host reads it
(``raise_if_refused(wait_for_device=True)``, the module's ``check_errors``).
"""

from typing import NamedTuple, Optional

import torch

from dynamicemb.ops import for_device
from dynamicemb.ops.interface import offsets_problem
from dynamicemb.table.device_counts import CountsCopy, capturing

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
        offsets, num_indices: the batch's offsets and number of ids (for the message).
        refused: set once the host has read that the check failed: the batch's
            backward then does nothing.
    """

    def __init__(self) -> None:
        self.offsets: Optional[torch.Tensor] = None
        self.num_indices = 0
        self.refused = False


class _Pending(NamedTuple):
    batch: CheckedBatch
    word: torch.Tensor  # the word its kernels read


class InputErrors:
    """The error word of one module and the batch it was last written for.

    Args:
        device: the module's device.
        at_once: raise in the call that gets a bad batch (on a GPU a sync per step; the
            CPU reads the word for free and always raises at once).
    """

    def __init__(self, device: torch.device, at_once: bool = False) -> None:
        self.word = torch.zeros(1, dtype=torch.int64, device=device)
        self.at_once = at_once
        self._copy = CountsCopy(1, device)  # the word, on its way to the host
        self._pending: Optional[_Pending] = None

    def check(self, batch: CheckedBatch, offsets: torch.Tensor, num_indices: int,
              word: Optional[torch.Tensor] = None) -> None:
        """Enqueues the check of ``batch``'s ``offsets`` into ``word`` (default the
        module's; a prefetch has its own, so that a refused prefetch refuses no step
        around it); the word starts for the host (with ``at_once``, the error is
        raised now). The batch checked before must have been read
        (``raise_if_refused``): one is pending at a time."""
        word = self.word if word is None else word
        for_device(word.device).check_offsets(offsets=offsets, num_indices=num_indices,
                                              error=word)
        batch.offsets, batch.num_indices = offsets, num_indices
        if capturing():  # a graph's replays are checked by reading the word itself; the
            return  # batch checked before the capture stays pending
        self._copy.start(word)
        self._pending = _Pending(batch, word)
        if self.at_once:
            self.raise_if_refused()

    def raise_if_refused(self, wait_for_device: bool = False) -> None:
        """Raises ``ValueError`` if the batch checked last was refused; then the word
        is cleared. Waits only for the copy of that batch's word (see the module
        docstring); ``wait_for_device``: reads the word itself (a sync), whatever
        ran since (a CUDA graph's replays)."""
        if capturing() and not wait_for_device:  # no waiting inside a capture: the next
            return  # call checks the pending batch
        pending, self._pending = self._pending, None
        if wait_for_device:
            problem = offsets_problem(int(self.word[0]))
        elif pending is None:
            return
        else:
            problem = offsets_problem(self._copy.wait()[0])
        if not problem:
            return
        batch = pending.batch if pending is not None else CheckedBatch()
        batch.refused = True
        if pending is None or pending.word is self.word:
            self.word.zero_()  # a prefetch's own word is not used again
        if batch.offsets is None or not _problem_of(batch.offsets, batch.num_indices):
            # the word was set by a batch no call saw checked: a CUDA graph's replay
            raise ValueError(
                f"a batch's offsets were refused on the device ({_PROBLEMS[problem]}); "
                f"it and every batch after it until this error changed no table")
        when = ("no table changed" if self.at_once else
                "in the batch given to the call before this one, whose output was zeros; "
                "no table changed")
        raise ValueError(f"{offsets_message(problem, batch.offsets, batch.num_indices)} "
                         f"(found on the device: {when})")


_PROBLEMS = {1: "they did not start at 0", 2: "they did not end at len(indices)",
             3: "they decreased"}


def _problem_of(offsets: torch.Tensor, num_indices: int) -> int:
    """The problem code of ``offsets`` found on the host (after the device found one)."""
    values = offsets.cpu()
    if int(values[0]) != 0:
        return 1
    if int(values[-1]) != num_indices:
        return 2
    return 3 if bool((values[1:] < values[:-1]).any()) else 0
