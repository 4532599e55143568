"""Upstream's ``dynamicemb.batched_dynamicemb_tables``: ``BatchedDynamicEmbeddingTablesV2``
is ``BatchedDynamicEmbeddingTables``."""

from dynamicemb._upstream import module_getattr
from dynamicemb.embedding.module import BatchedDynamicEmbeddingTables

__all__ = ["BatchedDynamicEmbeddingTables", "BatchedDynamicEmbeddingTablesV2"]

BatchedDynamicEmbeddingTablesV2 = BatchedDynamicEmbeddingTables

# upstream's checkpoint file names: refused by name (this package's format differs)
__getattr__ = module_getattr("dynamicemb.batched_dynamicemb_tables", lazy={}, refused=(
    "encode_checkpoint_file_path", "encode_meta_json_file_path"))
