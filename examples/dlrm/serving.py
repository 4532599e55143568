"""The DLRM job's serving artifact (``--serving-artifact DIR``).

After training, every rank dumps the dynamic tables (``DIR/dynamic``, a
``DynamicEmbDump``) and joins the gathers of the sharded dense and static weights;
rank 0 builds the unsharded model, loads those weights, swaps its embedding
collection for the frozen twin (``dynamicemb.to_inference``), exports the DLRM with
``torch.export`` (any batch size) and saves ``DIR/model.pt2`` beside ``DIR/sample.pt``:
a batch and the trained model's eval logits for it. A server needs only
``import dynamicemb`` and ``torch.export.load``; ``load`` below is that server.
"""

import os
from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb import DynamicEmbDump, to_inference

PROGRAM, SAMPLE = "model.pt2", "sample.pt"


class ServedDLRM(nn.Module):
    """The DLRM on plain tensors: dense (B, D) float, ids (F * B,) int64 (one per
    sample and feature, feature-major) -> logits (B,)."""

    def __init__(self, dlrm: nn.Module, features: List[str]) -> None:
        super().__init__()
        self.dlrm, self.features = dlrm, features

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        lengths = torch.ones_like(ids, dtype=torch.int32)
        kjt = KeyedJaggedTensor(keys=self.features, values=ids, lengths=lengths)
        return self.dlrm(dense, kjt).squeeze(-1)


def _full_weights(dmp) -> Dict[str, torch.Tensor]:
    """Every dense and static weight, whole, on rank 0 (every rank joins the gathers;
    dynamic tables' placeholders are skipped)."""
    full = {}
    for key, value in dmp.state_dict().items():
        if hasattr(value, "local_shards"):  # a sharded static table
            if value.size().numel() == 0:
                continue
            out = torch.empty(value.size()) if dist.get_rank() == 0 else None
            value.gather(0, out)
            full[key] = out
        elif isinstance(value, torch.Tensor) and value.numel():
            full[key] = value.detach().cpu()
    return full


def _materialized(model: nn.Module) -> nn.Module:
    """``model`` with its meta tensors (the tables) allocated on CPU, uninitialized;
    the rest keeps its values (``to_empty`` would also empty the non-persistent
    buffers the state dict does not restore, e.g. the interaction's indices)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(p, device="cpu"),
                                                   requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device="cpu")
    return model


def write(directory: str, dmp, build_model, tables, batch) -> None:
    """Every rank: writes the serving artifact (see the module docstring).

    Args:
        build_model: () -> the unsharded ``DLRMTrain`` on ``meta``.
        tables: the job's ``TableSpec``s (feature order).
        batch: this rank's sample ``TorchRecBatch`` (rank 0's is saved).
    """
    DynamicEmbDump(os.path.join(directory, "dynamic"), dmp, allow_overwrite=True)
    weights = _full_weights(dmp)
    dmp.eval()
    with torch.no_grad():
        _, (_, logits, _) = dmp(batch)
    dmp.train()
    if dist.get_rank() == 0:
        model = _materialized(build_model())
        missing = model.load_state_dict(weights, strict=False).missing_keys
        dynamic = [k for k in missing if "embedding" not in k]
        if dynamic:
            raise RuntimeError(f"serving artifact: no weights for {dynamic}")
        dlrm = to_inference(model, checkpoint=os.path.join(directory, "dynamic")).model
        served = ServedDLRM(dlrm, [t.feature for t in tables]).eval()
        dense = batch.dense_features.cpu()
        ids = batch.sparse_features.values().cpu()
        batch_dim = torch.export.Dim("batch", min=2)
        program = torch.export.export(served, (dense, ids), dynamic_shapes={
            "dense": {0: batch_dim}, "ids": {0: batch_dim * len(tables)}})
        torch.export.save(program, os.path.join(directory, PROGRAM))
        torch.save({"dense": dense, "ids": ids, "logits": logits.detach().cpu()},
                   os.path.join(directory, SAMPLE))
    dist.barrier()


def load(directory: str):
    """The exported model and its sample (dense, ids, the trained model's logits)."""
    program = torch.export.load(os.path.join(directory, PROGRAM))
    return program.module(), torch.load(os.path.join(directory, SAMPLE), weights_only=True)
