"""Run by test_crash_safety: forks children that train and dump to argv[1] forever,
printing each finished dump, until the test kills them."""

import os
import sys

import torch

from ckpt_testing import make_tables, train
from dynamicemb import DynamicEmbDump

BASE_ROWS = 6000


def base_module():
    """A module big enough that a dump takes a while (about 4.6 MB of rows)."""
    module = make_tables(dims=(64, 4), capacity=1 << 16)
    g = torch.Generator().manual_seed(5)
    keys = torch.arange(BASE_ROWS, dtype=torch.int64) * 1000003 - 5 * 10**8
    module.import_keys_values("a", keys, torch.randn(BASE_ROWS, 64, generator=g),
                              torch.rand(BASE_ROWS, 128, generator=g), scores=keys % 1000)
    return module


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
