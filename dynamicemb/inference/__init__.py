"""Serving: frozen dynamic tables, lookup only, exportable; the TorchRec-facing twins
are in ``dynamicemb.inference.collections`` (which imports TorchRec)."""

from dynamicemb.inference.checkpoint import read_rows
from dynamicemb.inference.module import InferenceEmbeddingTables
from dynamicemb.inference.ops import frozen_lookup
from dynamicemb.inference.swap import to_inference
from dynamicemb.types import ROW_DTYPES

__all__ = ["InferenceEmbeddingTables", "ROW_DTYPES", "frozen_lookup", "read_rows",
           "to_inference"]
