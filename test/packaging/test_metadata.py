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
    assert requirement_names("partition") == {"pymetis"}


# One process in which `import torchrec` fails as it does where TorchRec is not
# installed. Each statement of argv runs from the state the core's imports left: the
# dynamicemb modules it added are dropped before the next, as a new process would not
# have them (a process per statement cost 6 s each).
_WITHOUT_TORCHREC = """
import sys
class NoTorchRec:
    def find_spec(self, name, path=None, target=None):
        if name == "torchrec" or name.startswith("torchrec."):
            raise ImportError("No module named 'torchrec'")
sys.meta_path.insert(0, NoTorchRec())
import dynamicemb, dynamicemb.table, dynamicemb.checkpoint  # the core needs no TorchRec
core = set(sys.modules)
for statement in sys.argv[1:]:
    try:
        exec(statement, {})
    except ImportError as err:
        print("ERROR", err)
    else:
        print("IMPORTED")
    print(SEPARATOR)
    for name in [m for m in sys.modules if m not in core and m.split(".")[0] == "dynamicemb"]:
        del sys.modules[name]
"""
SEPARATOR = "-" * 20 + " next statement " + "-" * 20
LAYERS = [
    ("import dynamicemb.shard", "dynamicemb.shard"),
    ("import dynamicemb.planner", "dynamicemb.planner"),
    ("import dynamicemb.plan; dynamicemb.plan.to_sharding_plan", "dynamicemb.plan.to_sharding_plan"),
    # upstream's paths over TorchRec name themselves, not dynamicemb.compat, where the code is
    ("import dynamicemb.get_planner", "dynamicemb.get_planner"),
    ("from dynamicemb.utils import TORCHREC_TYPES", "dynamicemb.utils"),
]


@pytest.fixture(scope="module")
def without_torchrec():
    """{statement: what running it printed} in the one process without TorchRec."""
    statements = [statement for statement, _ in LAYERS]
    done = run_python(["-c", f"SEPARATOR = {SEPARATOR!r}\n" + _WITHOUT_TORCHREC, *statements], check=True)
    outputs = done.stdout.split(SEPARATOR + "\n")
    assert len(outputs) == len(statements) + 1 and outputs[-1] == "", done.stdout
    return dict(zip(statements, outputs))


@pytest.mark.parametrize("statement, named", LAYERS)
def test_torchrec_layers_say_how_to_install_torchrec(without_torchrec, statement, named):
    out = without_torchrec[statement]
    assert out.startswith("ERROR"), out
    for words in (named, "pip install 'dynamicemb[torchrec]'", "fbgemm-gpu-cpu", "--no-deps"):
        assert words in out
