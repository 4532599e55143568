"""What a user does first with an installed wheel, checked against hand-computed values.

Run by test_wheel.py with the fresh venv's python, from a folder outside the checkout:
it fails (non-zero exit) if ``dynamicemb`` comes from anywhere but that venv.
"""

import logging
import os
import sys

import torch

logging.basicConfig(level=logging.DEBUG, format="%(name)s %(message)s")

import dynamicemb  # noqa: E402
from dynamicemb import (  # noqa: E402
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimType,
    DynamicEmbTableOptions,
)
from dynamicemb.ops import for_device  # noqa: E402
from dynamicemb.ops.cuda import cuda_source_root  # noqa: E402
from dynamicemb.table import ScoredHashTable  # noqa: E402

# Imported from the venv, not from a checkout; nothing beyond the declared dependencies.
assert os.path.abspath(dynamicemb.__file__).startswith(os.path.abspath(sys.prefix)), dynamicemb.__file__
try:
    import torchrec  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("torchrec is importable: the venv has more than the wheel declares")

# The table: every key inserted is found, an absent one is not.
table = ScoredHashTable(capacity=4096)
keys = torch.tensor([10**15, -3, 7, 123456789], dtype=torch.int64)
table.find_or_insert(keys)
slots = table.find(torch.cat([keys, torch.tensor([42])]))
assert (slots >= 0).tolist() == [True, True, True, True, False], slots

# A training step: constant rows 0.25, SUM pooling, loss = sum of the outputs, SGD at
# lr 0.5, so each row drops by 0.5 times the number of bags it appears in.
tables = BatchedDynamicEmbeddingTables(
    [DynamicEmbTableOptions(dim=4, max_capacity=1 << 12, initializer_args=DynamicEmbInitializerArgs(
        mode="constant", value=0.25))],
    table_names=["t"], feature_table_map=[0],
    optimizer=DynamicEmbOptimType.EXACT_SGD, learning_rate=0.5,
)
indices = torch.tensor([7, 7, 8, 10**15, 7], dtype=torch.int64)
offsets = torch.tensor([0, 2, 4, 5], dtype=torch.int64)  # bags [7, 7], [8, 10**15], [7]
out = tables(indices, offsets)
torch.testing.assert_close(out, torch.full((3, 4), 0.25) * torch.tensor([[2.0], [2.0], [1.0]]))
out.sum().backward()

# The eval lookup reads the updated rows; an unseen id reads zeros and is not inserted.
tables.eval()
with torch.no_grad():
    rows = tables(torch.tensor([7, 8, 10**15, 99]), torch.arange(5))
expected = torch.tensor([0.25 - 0.5 * 3, 0.25 - 0.5, 0.25 - 0.5, 0.0]).unsqueeze(1).expand(4, 4)
torch.testing.assert_close(rows, expected)

# The CUDA backend's run-time sources travel with the wheel.
root = cuda_source_root()
assert root.startswith(os.path.abspath(sys.prefix)), root
assert any(n.endswith(".cu") for n in os.listdir(os.path.join(root, "cuda"))), root
assert os.path.isfile(os.path.join(root, "dynamicemb", "table_view.h")), root

print("SMOKE OK", for_device("cpu").kernels.__name__)
