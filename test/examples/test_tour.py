"""The API tour (examples/tour.py) runs to the end."""

import os

from dynamicemb_testing.scripts import ROOT, run_python


def test_tour_runs():
    done = run_python([os.path.join(ROOT, "examples", "tour.py")], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ScoredHashTable" in done.stdout
