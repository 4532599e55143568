"""``to_inference``: a trained model's dynamic modules swapped for their frozen twins."""

import sys
from typing import Optional

import torch
from torch import nn

from dynamicemb.embedding import BatchedDynamicEmbeddingTables
from dynamicemb.inference.module import InferenceEmbeddingTables

__all__ = ["to_inference"]


def to_inference(model: nn.Module, *, checkpoint: Optional[str] = None,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> nn.Module:
    """Swaps, in place, every dynamic module of ``model`` for its inference twin and
    returns ``model`` in eval mode: ``BatchedDynamicEmbeddingTables`` (rows from the
    module or ``checkpoint``) and, with TorchRec and a ``checkpoint``, unsharded
    ``EmbeddingCollection``/``EmbeddingBagCollection`` (static tables from their weights).

    Args:
        model: the trained model, not sharded (dump a DMP model with ``DynamicEmbDump``
            and convert the unsharded one with ``checkpoint=``).
        checkpoint: a ``DynamicEmbDump`` directory of any world size and sharding.
        dtype: how frozen rows are stored (float32, float16, bfloat16); None: as each
            module's tables store them (float32 for TorchRec's).
        device: where the twins live (default: each module's).

    Raises:
        ValueError: a sharded model, a table missing from the checkpoint, another dtype.
        CheckpointError: a damaged checkpoint. Either way nothing is swapped.
    """
    twins = {}
    for name, module in model.named_modules():
        if any(name.startswith(done + ".") for done in twins):
            continue
        twin = _twin(module, checkpoint, dtype, device)
        if twin is not None:
            twins[name] = twin
    for name, twin in twins.items():  # every twin built: now swap
        if name == "":
            return twin.eval()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, twin)
    return model.eval()


def _twin(module: nn.Module, checkpoint, dtype, device) -> Optional[nn.Module]:
    if isinstance(module, BatchedDynamicEmbeddingTables):
        if checkpoint is None:
            return InferenceEmbeddingTables.from_module(module, dtype=dtype, device=device)
        from dynamicemb.inference.checkpoint import read_rows  # noqa: PLC0415
        rows, _ = read_rows(checkpoint, module.table_names)
        return InferenceEmbeddingTables(
            module.table_options, module.table_names, module.feature_table_map, rows=rows,
            pooling_mode=module.pooling_mode, dtype=dtype, output_dtype=module.output_dtype,
            device=device if device is not None else module.device)
    if "torchrec" not in sys.modules:
        return None
    from dynamicemb.inference.collections import collection_twin  # noqa: PLC0415 (TorchRec)
    return collection_twin(module, checkpoint, dtype, device)
