"""A progress bar for large dumps and loads: tqdm on rank 0 when it is installed."""

from typing import Optional

__all__ = ["PROGRESS_MIN_BYTES", "Progress"]

#: Dumps and loads of fewer bytes than this show no bar.
PROGRESS_MIN_BYTES = 256 << 20


class Progress:
    """Counts bytes; shows a tqdm bar if ``show`` and ``total`` >= ``PROGRESS_MIN_BYTES``."""

    def __init__(self, description: str, total: int, show: bool) -> None:
        self._bar: Optional[object] = None
        if show and total >= PROGRESS_MIN_BYTES:
            try:
                from tqdm import tqdm  # optional: no bar without it
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=description, unit="B", unit_scale=True)

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
