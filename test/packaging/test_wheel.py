"""The package as users install it: ``python -m build`` makes an sdist and, from it, a
wheel; the wheel goes into a fresh venv that holds only torch and the wheel's declared
dependencies, and a smoke script runs there from outside the checkout.

The fresh venv gets torch and numpy without a download: their installed distributions
(and those they require) are linked into a folder that a ``.pth`` file puts on the venv's
path, so pip sees them as installed and checks the wheel's requirements against them
(``--no-index``: a requirement they do not meet fails the install).
"""

# CPU only: builds the CPU extension's copies and runs them.

import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest
import torch
from packaging.requirements import Requirement

from dynamicemb.ops import cpu_kernels
from dynamicemb_testing.scripts import ROOT

pytestmark = pytest.mark.slow
SMOKE = pathlib.Path(__file__).with_name("wheel_smoke.py")


def run(args, **kwargs):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def clean_env(**extra):
    """No PYTHONPATH (nothing from the checkout) and no forced kernel copy."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "DYNAMICEMB_CPU_KERNELS", "DYNAMICEMB_CPU_ARCH")}
    return dict(env, **extra)


def no_debug_info_flags() -> dict:
    """``CFLAGS``/``CXXFLAGS`` for the build: what the build would take (the
    environment's, else Python's ``CFLAGS``, as setuptools takes them) with ``-g0``
    last, which drops the debug info.

    Nothing here reads debug info, and it cost about 40% of the build's compile time
    (the bindings file, built once per copy, took 57 s with it and 30 s without on this
    2-core VM). Every other flag (-O3, -fwrapv, -DNDEBUG, each copy's -march) is kept.
    """
    default = sysconfig.get_config_var("CFLAGS") or ""
    return {name: f"{os.environ.get(name, default)} -g0" for name in ("CFLAGS", "CXXFLAGS")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT],
        env=clean_env(**no_debug_info_flags()), timeout=1800)
    (sdist,), (wheel,) = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    return sdist, wheel


def closure(names):
    """``names`` and every distribution they require (markers evaluated here)."""
    seen, todo = {}, list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen[name] = importlib.metadata.distribution(name)
        for text in seen[name].requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def link_distributions(dists, folder: pathlib.Path):
    """Symlinks each distribution's top-level entries (packages, dist-info) into folder."""
    folder.mkdir()
    for dist in dists.values():
        base = pathlib.Path(dist.locate_file(""))
        for top in {pathlib.PurePath(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (base / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(base / top)


def test_the_sdist_carries_every_source_and_no_binary(dist):
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = {str(p.relative_to(ROOT)) for p in pathlib.Path(ROOT, "csrc").rglob("*") if p.is_file()}
    assert sources and sources <= names, sorted(sources - names)
    assert {"setup.py", "pyproject.toml", "dynamicemb/ops/cpu_kernels.py"} <= names
    assert not [n for n in names if n.endswith((".so", ".o", ".whl"))]


def test_the_wheel_carries_each_cpu_copy_and_the_cuda_sources(dist):
    _, wheel = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    copies = {n.split("/")[1].split(".")[0] for n in names if re.match(r"dynamicemb/_C_\w+\.[^/]*so$", n)}
    assert copies == {"_C_x86_64_v4", "_C_x86_64_v3", "_C_baseline"} or copies == {"_C_baseline"}
    cuda = {n for n in names if n.startswith("dynamicemb/csrc/")}
    for folder in ("cuda", "dynamicemb"):
        for source in pathlib.Path(ROOT, "csrc", folder).iterdir():
            assert f"dynamicemb/csrc/{folder}/{source.name}" in cuda
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    # Bound to the torch it was built against (the C++ ABI), to the minor version.
    minor = ".".join(torch.__version__.split(".")[:2])
    assert re.search(rf"^Requires-Dist: torch=={re.escape(minor)}\.\*$", metadata, re.M), metadata


def test_the_wheel_trains_in_a_fresh_venv_outside_the_checkout(dist, tmp_path):
    _, wheel = dist
    venv = tmp_path / "venv"
    # No pip of its own (ensurepip took 5 s, and its old setuptools would hide the one
    # torch requires): this pip installs into it (``--python``, pip >= 22.3), resolving
    # against what the venv's interpreter sees.
    run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=300)
    python = venv / "bin" / "python"
    site = pathlib.Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    link_distributions(closure(["torch", "numpy"]), tmp_path / "deps")
    (site / "deps.pth").write_text(f"{tmp_path / 'deps'}\n")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--find-links",
         wheel.parent, "dynamicemb"], env=clean_env(), cwd=tmp_path, timeout=600)
    assert not (site / "setuptools").exists() and (site / "dynamicemb").is_dir()
    smoke = run([python, SMOKE], env=clean_env(), cwd=tmp_path, timeout=600)
    assert f"SMOKE OK dynamicemb._C_{cpu_kernels.runnable()[0]}" in smoke.stdout, smoke.stdout
    assert "dynamicemb CPU kernels: dynamicemb._C_" in smoke.stderr
