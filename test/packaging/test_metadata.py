"""What pip reads: declared dependencies and extras, one version string, and a clear
error for the TorchRec layers where TorchRec is not installed."""

import importlib.metadata

import pytest

import dynamicemb
from dynamicemb_testing.scripts import run_python


def requirement_names(extra=None):
    names = set()
    for req in importlib.metadata.requires("dynamicemb") or []:
        spec, _, marker = req.partition(";")
        in_extra = f'extra == "{extra}"' in marker
        if (extra is None and not marker.strip()) or (extra is not None and in_extra):
            names.add(spec.strip().split(">")[0].split("=")[0].split("<")[0].strip())
    return names


def test_the_installed_version_is_the_package_version():
    assert importlib.metadata.version("dynamicemb") == dynamicemb.__version__


def test_torch_is_a_requirement_and_the_optional_stacks_are_extras():
    assert {"torch", "numpy"} <= requirement_names()
    assert "torchrec" not in requirement_names()  # it would pull in the CUDA fbgemm-gpu
    assert requirement_names("torchrec") == {"torchrec"}
    assert requirement_names("cuda") == {"cupy-cuda13x"}
    assert {"tqdm", "torchmetrics", "pyarrow", "matplotlib"} <= requirement_names("examples")


# A process in which `import torchrec` fails as it does where TorchRec is not installed.
_WITHOUT_TORCHREC = """
import sys
class NoTorchRec:
    def find_spec(self, name, path=None, target=None):
        if name == "torchrec" or name.startswith("torchrec."):
            raise ImportError("No module named 'torchrec'")
sys.meta_path.insert(0, NoTorchRec())
import dynamicemb, dynamicemb.table, dynamicemb.checkpoint  # the core needs no TorchRec
try:
    import {module}
except ImportError as err:
    print("ERROR", err)
else:
    print("IMPORTED")
"""


@pytest.mark.parametrize("module, named", [
    ("dynamicemb.shard", "dynamicemb.shard"),
    ("dynamicemb.planner", "dynamicemb.planner"),
    ("dynamicemb.plan; dynamicemb.plan.to_sharding_plan", "dynamicemb.plan.to_sharding_plan"),
])
def test_torchrec_layers_say_how_to_install_torchrec(module, named):
    done = run_python(["-c", _WITHOUT_TORCHREC.format(module=module)], check=True)
    assert done.stdout.startswith("ERROR"), done.stdout
    for words in (named, "pip install 'dynamicemb[torchrec]'", "fbgemm-gpu-cpu", "--no-deps"):
        assert words in done.stdout
