"""A clean interpreter exit for processes with a Gloo process group.

``install()`` frees the groups at exit while the interpreter is whole, or a Gloo worker
may abort it (``docs/ARCHITECTURE.md``, "A clean exit"). Import ``dynamicemb`` before
``init_process_group``: importing ``torch._dynamo`` after a group exists keeps it alive.
"""

import atexit
import gc
import sys
import time
import weakref

__all__ = ["install", "release_process_groups"]

_installed = False
# Seconds a still-referenced group's worker threads get the GIL to release their work.
GRACE_S = 0.05


def _live_groups():
    """Weak references to every process group the c10d registry knows, or []."""
    import torch.distributed as dist  # noqa: PLC0415 (torch is imported by then)

    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.distributed.distributed_c10d import _world  # noqa: PLC0415

    refs = []
    for group in list(_world.pg_map):
        try:
            refs.append(weakref.ref(group))
        except TypeError:  # a group type without weak references: assume it lives on
            refs.append(lambda group=group: group)
    return refs


def _all_gloo(dist) -> bool:
    """Whether every registered group is Gloo (NCCL groups are left to their own shutdown)."""
    from torch.distributed.distributed_c10d import _world  # noqa: PLC0415

    return all(dist.get_backend(group) == "gloo" for group in list(_world.pg_map))


def release_process_groups() -> bool:
    """Destroys every process group if all are Gloo, collects garbage, and gives the
    threads of a group still referenced ``GRACE_S`` seconds; True if none outlives it."""
    if "torch.distributed" not in sys.modules:  # never initialized in this process
        return True
    import torch.distributed as dist  # noqa: PLC0415

    groups = _live_groups()
    if groups and _all_gloo(dist):
        dist.destroy_process_group()
    gc.collect()  # a group kept only by a cycle (a sharded model's) is freed here
    if any(ref() is not None for ref in groups):
        time.sleep(GRACE_S)  # releases the GIL: in-flight work destructors finish
        return False
    return True


def _at_exit() -> None:
    try:
        release_process_groups()
    except Exception as error:  # never turn a finished job into a failed exit
        print(f"dynamicemb: releasing the process group at exit failed: {error!r}",
              file=sys.stderr, flush=True)


def install() -> None:
    """Registers the exit hook once per process (idempotent)."""
    global _installed
    if not _installed:
        atexit.register(_at_exit)
        _installed = True
