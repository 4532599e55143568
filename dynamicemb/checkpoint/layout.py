"""The checkpoint directory and its atomic switch from one version to the next.

``path`` holds ``CURRENT``, naming the version directory ``v<seq>-<token>/``. A dump
fsyncs a ``.tmp-*`` directory, renames it to a version, then ``os.replace``s
``CURRENT`` (atomic on POSIX), so it always names a complete version. Concurrent
dumps to one ``path`` are not supported.
"""

import os
import re
import shutil
import uuid
from typing import Optional

from dynamicemb.checkpoint.format import CheckpointError

__all__ = [
    "MANIFEST",
    "POINTER",
    "begin_version",
    "commit_version",
    "current_version",
    "discard",
    "has_checkpoint",
]

POINTER = "CURRENT"
MANIFEST = "manifest.json"
_TMP_PREFIX = ".tmp-"
_VERSION = re.compile(r"^v(\d{6,})-[0-9a-f]+$")


def fsync_dir(path: str) -> None:
    """Makes renames and new entries in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def has_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint directory with a current version."""
    return os.path.isfile(os.path.join(path, POINTER))


def current_version(path: str) -> str:
    """The directory of the version ``CURRENT`` names; ``CheckpointError`` if none."""
    pointer = os.path.join(path, POINTER)
    try:
        with open(pointer, "r", encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint here (no {POINTER} file)") from None
    if not _VERSION.match(name) or not os.path.isdir(os.path.join(path, name)):
        raise CheckpointError(f"{pointer}: names {name!r}, which is not a version directory")
    return os.path.join(path, name)


def begin_version(path: str, allow_overwrite: bool) -> str:
    """Creates ``path`` if needed and an empty temporary version directory in it;
    ``CheckpointError`` if ``path`` is a file, another non-empty directory, or a
    checkpoint without ``allow_overwrite``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path}: exists and is not a directory")
    if has_checkpoint(path):
        if not allow_overwrite:
            raise CheckpointError(
                f"{path}: already holds a checkpoint; pass allow_overwrite=True to replace it")
    elif os.path.isdir(path) and any(not n.startswith(_TMP_PREFIX) for n in os.listdir(path)):
        raise CheckpointError(f"{path}: a non-empty directory that is not a checkpoint")
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
    os.mkdir(tmp)
    return tmp


def _next_sequence(path: str) -> int:
    numbers = [int(m.group(1)) for m in map(_VERSION.match, os.listdir(path)) if m]
    return max(numbers, default=0) + 1


def commit_version(path: str, tmp: str) -> str:
    """Makes the complete directory ``tmp`` the current version, removes the others and
    returns the version directory."""
    fsync_dir(tmp)
    name = f"v{_next_sequence(path):06d}-{uuid.uuid4().hex[:12]}"
    version = os.path.join(path, name)
    os.rename(tmp, version)
    fsync_dir(path)
    pointer_tmp = os.path.join(path, f"{_TMP_PREFIX}{POINTER}")
    with open(pointer_tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, os.path.join(path, POINTER))  # the switch
    fsync_dir(path)
    _remove_others(path, keep=name)
    return version


def _remove_others(path: str, keep: str) -> None:
    for entry in os.listdir(path):
        if entry != keep and (_VERSION.match(entry) or entry.startswith(_TMP_PREFIX)):
            discard(os.path.join(path, entry))


def discard(directory: Optional[str]) -> None:
    """Removes a temporary or superseded version (a file or a directory)."""
    if directory is None or not os.path.lexists(directory):
        return
    if os.path.isdir(directory) and not os.path.islink(directory):
        shutil.rmtree(directory, ignore_errors=True)
    else:
        os.unlink(directory)
