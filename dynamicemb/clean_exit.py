"""A clean interpreter exit for processes with a Gloo process group.

The abort it prevents ("terminate called without an active exception", SIGABRT,
after the work is done): a Gloo worker thread (``ProcessGroupGloo::runLoop``)
releases the last reference to a finished work object (e.g. ``AsyncAlltoallWork``)
a moment *after* the caller's ``wait()`` returned. When that work holds tensors whose
Python objects are kept alive by C++ (PyTorch's PyObject preservation), releasing
them takes the GIL; if the main thread is already in ``Py_FinalizeEx`` by then,
``take_gil`` ends the worker thread with ``pthread_exit``, whose forced unwind
through a ``noexcept`` C++ frame calls ``std::terminate``. The process group's
C++ destructor drains the work queue and joins these threads, but only if it runs
while the interpreter is alive: ``destroy_process_group()`` drops only the
registry's references, and a model (TorchRec's ``ShardingEnv``), a reference cycle
or a global can keep the group until finalization.

``install()`` (run when ``dynamicemb`` is imported) registers an ``atexit`` hook
that runs while the interpreter is still whole: it destroys the default process
group if the program did not (when every group is Gloo), collects garbage so that
an unreferenced group's destructor joins its worker threads there, and, for a group
that something still holds, lets the worker threads take the GIL for a moment to
release what they hold. One such holder is PyTorch itself: importing ``torch._dynamo``
(``dynamicemb`` does, for its ``torch.compiler.disable``) after a group exists keeps
that group alive (measured with torch 2.13); import ``dynamicemb`` before
``init_process_group``, as scripts do, and the group is freed.
"""

import atexit
import gc
import sys
import time
import weakref

__all__ = ["install", "release_process_groups"]

_installed = False
# Seconds the hook lets a still-referenced group's worker threads run (they need the
# GIL once, for microseconds, to release a finished work).
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
    """Whether every registered group runs on Gloo only (the race is Gloo's; an NCCL
    group is left to its own shutdown, whose teardown may involve the peers)."""
    from torch.distributed.distributed_c10d import _world  # noqa: PLC0415

    return all(dist.get_backend(group) == "gloo" for group in list(_world.pg_map))


def release_process_groups() -> bool:
    """Destroys the default process group (and every other) if it is still
    initialized and all Gloo, collects garbage, and gives the worker threads of any
    group that is still referenced ``GRACE_S`` seconds to finish with the GIL.

    Returns:
        True if no process group object outlives the call (its threads are joined).
    """
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
