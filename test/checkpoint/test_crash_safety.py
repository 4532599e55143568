"""A dump that dies at any point leaves the previous checkpoint loadable and intact."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from dynamicemb import DynamicEmbDump, DynamicEmbLoad
from dynamicemb.checkpoint import dump, format, layout
from dynamicemb_testing.checkpoint_testing import assert_same, base_module, make_tables, snapshot, train
from dynamicemb_testing.scripts import script_env

HERE = os.path.dirname(os.path.abspath(__file__))


class _Crash(BaseException):
    """Stands for the process dying: not an Exception, so no clean-up runs."""


class _CrashingOs:
    """``os`` whose filesystem-changing calls count, the ``at``-th raising ``_Crash``."""

    CHANGING = {"rename", "replace", "fsync", "mkdir", "makedirs", "unlink"}

    def __init__(self, real, counter):
        self._real, self._counter = real, counter

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self.CHANGING:
            return attr

        def counted(*args, **kwargs):
            self._counter.tick()
            return attr(*args, **kwargs)
        return counted


class _Counter:
    def __init__(self, at):
        self.at, self.calls = at, 0

    def tick(self):
        self.calls += 1
        if self.calls == self.at:
            raise _Crash()


def _state(steps):
    module = make_tables()
    train(module, range(steps))
    return module


def test_a_crash_between_any_two_steps_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    old, new = _state(3), _state(5)
    DynamicEmbDump(path, old)
    expected_old, expected_new = snapshot(old), snapshot(new)
    at = 1
    while True:
        counter = _Counter(at)
        with monkeypatch.context() as m:
            m.setattr(layout, "os", _CrashingOs(os, counter))
            m.setattr(format, "os", _CrashingOs(os, counter))
            m.setattr(layout.shutil, "rmtree", lambda *a, **k: counter.tick())
            crashed = False
            try:
                DynamicEmbDump(path, new, allow_overwrite=True)
            except _Crash:
                crashed = True
        loaded = make_tables()
        DynamicEmbLoad(path, loaded)
        got = snapshot(loaded)
        # before the pointer switch: the old checkpoint; after it: the new one
        assert_same(got, expected_new if got["train_steps"] == 5 else expected_old)
        if not crashed:
            break
        DynamicEmbDump(path, old, allow_overwrite=True)  # back to the old one, garbage removed
        assert [n for n in os.listdir(path) if n.startswith(".tmp-")] == []
        at += 1
    assert at > 8  # every write, fsync, rename and removal was a crash point


def test_sigkill_at_random_moments_keeps_a_loadable_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    DynamicEmbDump(path, base_module())
    references = {}
    rng = random.Random(1234)
    env = script_env()
    seen = set()
    zygote = subprocess.Popen([sys.executable, os.path.join(HERE, "crash_dumper.py"), path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        for kill in range(10):
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            child = int(zygote.stdout.readline().split()[1])
            assert zygote.stdout.readline().startswith(f"{child} dumped")
            time.sleep(rng.uniform(0.0, 0.6))
            os.kill(child, signal.SIGKILL)  # the dumping process, wherever it is
            while zygote.stdout.readline().strip() != "reaped":
                pass
            _check_loads(path, references, seen)
    finally:
        zygote.kill()
        zygote.wait()
    assert len(seen) > 1  # the kills landed at different points of the loop


def _check_loads(path, references, seen):
    loaded = base_module()
    DynamicEmbLoad(path, loaded)
    steps = loaded.train_steps
    seen.add(steps)
    if steps not in references:
        reference = base_module()
        train(reference, range(steps))
        references[steps] = snapshot(reference)
    assert_same(snapshot(loaded), references[steps])
