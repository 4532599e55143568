"""Upstream dynamicemb's module path ``dynamicemb.exportable_tables``: its serving entry
points.

The code lives in ``dynamicemb.compat.exportable_tables``; this module only re-exports
it (``docs/MIGRATING.md``).
"""

from dynamicemb.compat.exportable_tables import (  # noqa: F401
    InferenceEmbeddingCollection,
    apply_inference_embedding_collection,
    create_inference_embedding_collection,
)

__all__ = [
    "InferenceEmbeddingCollection",
    "apply_inference_embedding_collection",
    "create_inference_embedding_collection",
]
