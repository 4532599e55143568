"""Serving: frozen dynamic tables, lookup only, exportable.

``InferenceEmbeddingTables`` is the inference twin of ``BatchedDynamicEmbeddingTables``
(built from a live module or a ``DynamicEmbDump`` checkpoint); its lookups run the
custom op ``torch.ops.dynamicemb.frozen_lookup``, registered when ``dynamicemb`` is
imported, so ``torch.compile`` traces it and a program saved by ``torch.export.save``
loads in a process that imports only ``dynamicemb``. ``to_inference`` swaps every
dynamic module of a model for its twin. The TorchRec-facing collections
(``InferenceEmbeddingCollection``, ``InferenceEmbeddingBagCollection``) live in
``dynamicemb.inference.collections`` and import TorchRec.
"""

from dynamicemb.inference.checkpoint import read_rows
from dynamicemb.inference.frozen import ROW_DTYPES
from dynamicemb.inference.module import InferenceEmbeddingTables
from dynamicemb.inference.ops import frozen_lookup
from dynamicemb.inference.swap import to_inference

__all__ = ["InferenceEmbeddingTables", "ROW_DTYPES", "frozen_lookup", "read_rows",
           "to_inference"]
