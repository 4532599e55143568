"""Upstream dynamicemb's ``dynamicemb.utils`` path: ``TORCHREC_TYPES``, the TorchRec
collections a planner plans (upstream's examples collect ``eb_configs`` from the
modules whose type is in it). Its other names are refused by name with what to use
instead."""

from dynamicemb._torchrec import require_torchrec
from dynamicemb._upstream import module_getattr

require_torchrec("dynamicemb.utils")

from torchrec.modules.embedding_modules import (  # noqa: E402
    EmbeddingBagCollection,
    EmbeddingCollection,
)

__all__ = ["TORCHREC_TYPES"]

#: The TorchRec collection types whose tables can be dynamic.
TORCHREC_TYPES = frozenset({EmbeddingBagCollection, EmbeddingCollection})

__getattr__ = module_getattr(__name__, lazy={}, refused=(
    "torch_to_dyn_emb", "DTYPE_NUM_BYTES", "tabulate", "assert_tensors_equal"))
