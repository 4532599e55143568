"""Fault injection for the rank-loss test: imported at interpreter start-up when this
folder is on ``PYTHONPATH``; inert unless ``DYNAMICEMB_KILL_RANK`` is set.

On the rank ``DYNAMICEMB_KILL_RANK`` (torchrun's ``RANK``), the first
``torch.distributed.all_to_all_single`` called once ``DYNAMICEMB_KILL_DIR/latest.json``
records a step >= ``DYNAMICEMB_KILL_AFTER_STEP`` writes the time to
``DYNAMICEMB_KILL_DIR/killed_at`` and SIGKILLs its own process: the rank dies inside a
training step's all-to-all, while its peers wait in theirs.
"""

import os

if os.environ.get("DYNAMICEMB_KILL_RANK") is not None and \
        os.environ.get("RANK") == os.environ["DYNAMICEMB_KILL_RANK"]:
    import json
    import signal
    import time

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    _DIR = os.environ["DYNAMICEMB_KILL_DIR"]
    _STEP = int(os.environ["DYNAMICEMB_KILL_AFTER_STEP"])
    _real = dist.all_to_all_single

    def _checkpointed_step() -> int:
        try:
            with open(os.path.join(_DIR, "latest.json")) as f:
                return int(json.load(f)["step"])
        except (OSError, ValueError, KeyError):
            return -1

    def all_to_all_single(*args, **kwargs):  # noqa: D103
        if _checkpointed_step() >= _STEP:
            with open(os.path.join(_DIR, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(*args, **kwargs)

    dist.all_to_all_single = c10d.all_to_all_single = all_to_all_single
