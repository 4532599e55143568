"""Runs the repository's scripts (examples, benchmarks, the README) in a subprocess
that imports this checkout's ``dynamicemb`` and the test helpers.

A script run as ``python path/to/script.py`` gets the script's folder on its path,
not the checkout: without ``PYTHONPATH`` it would import whatever ``dynamicemb`` the
interpreter has installed (possibly another checkout's).
"""

import os
import subprocess
import sys
from typing import Dict, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_DIR = os.path.join(ROOT, "test")


def script_env(**extra: str) -> Dict[str, str]:
    """This process's environment with the checkout and ``test/`` first on
    ``PYTHONPATH``, plus ``extra``."""
    paths = [ROOT, TEST_DIR]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)


def run_python(args: Sequence, *, env: Optional[Dict[str, str]] = None, timeout: float = 600,
               check: bool = False, cwd: str = ROOT) -> subprocess.CompletedProcess:
    """``python *args`` (a script path or ``-m module`` and its arguments) from ``cwd``
    (default: the checkout), text output captured.

    Args:
        args: interpreter arguments; non-strings are converted with ``str``.
        env: extra environment variables (added to ``script_env()``).
        timeout: seconds before the run is killed (``subprocess.TimeoutExpired``).
        check: fail with an ``AssertionError`` (the stderr's tail) on a non-zero exit.
    """
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=script_env(**(env or {})))
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done
