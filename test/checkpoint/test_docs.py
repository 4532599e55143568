"""The code in docs/CHECKPOINTS.md works as written."""

import os
import re
import subprocess
import sys

import pytest
import torch

from dynamicemb_testing.checkpoint_testing import DTYPES, make_tables, train
from dynamicemb import DynamicEmbDump

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "CHECKPOINTS.md")


def doc_block(heading: str) -> str:
    """The first python block after ``heading`` in docs/CHECKPOINTS.md."""
    text = open(DOC).read()
    after = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numpy_only_reader_reads_a_dump(tmp_path, dtype):
    """Of tables of each dtype: 16-bit rows widened exactly."""
    module = make_tables(dtype=dtype)
    train(module, range(4))
    DynamicEmbDump(str(tmp_path / "ck"), module)
    reader = doc_block("## Reading a dump with numpy only")
    script = reader + (
        "\nimport sys\n"
        "keys, rows = read_table(sys.argv[1], 'a')\n"
        "assert 'torch' not in sys.modules and 'dynamicemb' not in sys.modules\n"
        "np.save(sys.argv[2], keys); np.save(sys.argv[3], rows)\n")
    out = [str(tmp_path / "k.npy"), str(tmp_path / "r.npy")]
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "ck"), *out], check=True,
                   cwd=str(tmp_path))
    import numpy as np

    keys, rows = torch.from_numpy(np.load(out[0])), torch.from_numpy(np.load(out[1]))
    saved = module.export_keys_values("a")
    assert torch.equal(keys.sort().values, saved.keys.sort().values)
    order, ref = keys.argsort(), saved.keys.argsort()
    assert rows.dtype == torch.float32
    assert torch.equal(rows[order], saved.embeddings[ref].float())
