"""The shared per-key procedures of ``csrc/dynamicemb/table_view.h`` on their own.

``table_view_check.cpp`` drives twin tables through the same random calls (inserting
passes that hit, insert, evict and fail; erase; undo; growth by ``move_one``), one
probed by the header's default scalar probe and one by the CPU's SIMD probe
(``csrc/cpu/probe.h``), and checks both against a map of what the table holds and
against each other, byte for byte. It needs no torch: it also shows that the header
compiles with nothing but the repository's headers.
"""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = pathlib.Path(__file__).with_name("table_view_check.cpp")
COMPILER = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
def test_per_key_procedures_match_the_model(tmp_path):
    exe = tmp_path / "table_view_check"
    build = subprocess.run(
        [COMPILER, "-O2", "-std=c++17", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}", str(SOURCE),
         "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert " 0 wrong" in run.stdout
