"""The API tour (examples/tour.py) runs to the end."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tour_runs():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "tour.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ScoredHashTable" in done.stdout
