"""Launches real multi-node layouts on one machine: one ``torchrun`` agent per node,
static rendezvous on loopback (a free port), as users launch several nodes."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from dynamicemb_testing.dist_utils import free_port
from dynamicemb_testing.scripts import ROOT, script_env


def torchrun_node_args(nnodes: int, node_rank: int, nproc_per_node: int, port: int) -> List[str]:
    """The torchrun flags of one node of a loopback job (no restarts: a failure fails)."""
    return ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", str(nproc_per_node), "--master_addr", "127.0.0.1",
            "--master_port", str(port), "--max_restarts", "0"]


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _stop(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the agent's session: it and its workers
            proc.wait()


def run_agents(commands: Sequence[Sequence[str]], *, envs: Optional[Sequence[Dict[str, str]]] = None,
               timeout: float = 600) -> List[str]:
    """Runs one process per command at once (each a node's launcher: a torchrun
    agent or a script that execs one) from the checkout; returns their outputs.

    A process that exits non-zero (a worker failed) stops the others at once: a
    surviving torchrun agent would otherwise wait for it at the exit barrier.

    Args:
        commands: argv of each process.
        envs: extra environment variables of each (added to ``script_env``).
        timeout: seconds before every process is stopped.

    Raises:
        AssertionError: a process failed, or the job ran past ``timeout`` (the
            processes' output tails in the message).
    """
    envs = envs or [{}] * len(commands)
    with tempfile.TemporaryDirectory() as logs:
        paths = [os.path.join(logs, f"node{n}.log") for n in range(len(commands))]
        procs = []
        for command, env, path in zip(commands, envs, paths):
            with open(path, "w") as log:
                procs.append(subprocess.Popen(
                    list(map(str, command)), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                    env=script_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env), start_new_session=True))
        timed_out = _wait_all(procs, time.monotonic() + timeout)
        outputs = [_read(path) for path in paths]
    codes = [p.returncode for p in procs]
    if any(code != 0 for code in codes):
        how = f"timed out after {timeout}s" if timed_out else "failed"
        tails = "\n".join(f"--- node {n} (exit {c}) ---\n{out[-3000:]}" for n, (c, out) in
                          enumerate(zip(codes, outputs)))
        raise AssertionError(f"{' '.join(map(str, commands[0]))} {how} (exit codes {codes})\n{tails}")
    return outputs


def _wait_all(procs: List[subprocess.Popen], deadline: float) -> bool:
    """Waits until all exit, one fails or the deadline; stops the rest. True on timeout."""
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                return False
            if time.monotonic() > deadline:
                return True
            time.sleep(0.2)
        return False
    finally:
        _stop(procs)


def run_nodes(nnodes: int, nproc_per_node: int, args: Sequence[str], *, timeout: float = 600) -> List[str]:
    """``python <args>`` on ``nnodes`` x ``nproc_per_node`` ranks, one torchrun agent
    per node, all on this machine (``run_agents``); returns each node's output."""
    port = free_port()
    return run_agents([[sys.executable, *torchrun_node_args(nnodes, node, nproc_per_node, port), *args]
                       for node in range(nnodes)], timeout=timeout)
