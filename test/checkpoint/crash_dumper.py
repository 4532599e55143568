"""Run by test_crash_safety: forks children that train and dump to argv[1] forever,
printing each finished dump, until the test kills them."""

import os
import sys

import torch

from dynamicemb import DynamicEmbDump
from dynamicemb_testing.checkpoint_testing import base_module, train


def dump_forever(path: str) -> None:
    """Trains one step and dumps, again and again, printing each finished dump."""
    module = base_module()
    step = 0
    while True:
        train(module, range(step, step + 1))
        step += 1
        DynamicEmbDump(path, module, allow_overwrite=True)
        print(f"{os.getpid()} dumped {step}", flush=True)


if __name__ == "__main__":
    # A zygote: imports once, then forks a dumping child per "go" line on stdin (the
    # test kills the child) and reaps it. No torch work runs before a fork.
    torch.set_num_threads(1)
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            dump_forever(sys.argv[1])
        print(f"child {pid}", flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
