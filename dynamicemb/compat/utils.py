"""Upstream's ``dynamicemb.utils``: ``TORCHREC_TYPES`` and ``DTYPE_NUM_BYTES``; its other
names are refused."""

import torch

from dynamicemb._torchrec import require_torchrec
from dynamicemb._upstream import module_getattr

require_torchrec("dynamicemb.utils")

from torchrec.modules.embedding_modules import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingCollection,
)

__all__ = ["DTYPE_NUM_BYTES", "TORCHREC_TYPES"]

#: The TorchRec collection types whose tables can be dynamic.
TORCHREC_TYPES = frozenset({EmbeddingBagCollection, EmbeddingCollection})
#: Bytes of an element of each dtype upstream's sizes use (``dtype.itemsize``).
DTYPE_NUM_BYTES = {dtype: dtype.itemsize for dtype in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint64, torch.uint32, torch.int8, torch.uint8)}

__getattr__ = module_getattr("dynamicemb.utils", lazy={}, refused=(
    "torch_to_dyn_emb", "tabulate", "assert_tensors_equal"))
