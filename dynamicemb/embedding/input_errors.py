"""A module's input check on the training step: found by a kernel, raised by the host.

The check kernel writes a batch's offsets problem into an error word in device memory;
every later kernel of the step reads it, so a refused batch reads no offsets, pools to
zeros and changes no row. The word is copied asynchronously to pinned host memory and read
at the module's next call (``at_once``: in the call itself, a host sync per step), which
raises the error and clears the word. Under CUDA graph replays the word stays set, so every
later replay changes nothing, until ``raise_if_refused(wait_for_device=True)`` (the module's
``check_errors``) reads it.
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
    """A batch whose check is on its way to the host; ``refused`` is set once the host has
    read that the check failed (the batch's backward then does nothing)."""

    def __init__(self) -> None:
        self.offsets: Optional[torch.Tensor] = None
        self.num_indices = 0
        self.refused = False


class _Pending(NamedTuple):
    batch: CheckedBatch
    word: torch.Tensor  # the word its kernels read


class InputErrors:
    """The error word of one module and the batch it was last written for. ``at_once``:
    raise in the call that gets a bad batch (on a GPU a sync per step)."""

    def __init__(self, device: torch.device, at_once: bool = False) -> None:
        self.word = torch.zeros(1, dtype=torch.int64, device=device)
        self.at_once = at_once
        self._copy = CountsCopy(1, device)  # the word, on its way to the host
        self._pending: Optional[_Pending] = None

    def check(self, batch: CheckedBatch, offsets: torch.Tensor, num_indices: int,
              word: Optional[torch.Tensor] = None) -> None:
        """Enqueues the check of ``batch``'s ``offsets`` into ``word`` (default the module's;
        a prefetch has its own, so that its refusal refuses no step around it) and starts the
        word's copy to the host (``at_once``: raises now). One batch is pending at a time:
        the previous one must have been read (``raise_if_refused``)."""
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
        """Raises ``ValueError`` if the batch checked last was refused, clearing the word.
        Waits only for that word's copy; ``wait_for_device``: reads the word itself (a sync),
        covering whatever ran since (a CUDA graph's replays)."""
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
