"""Checkpoints of dynamic tables: dump, load (with resharding), incremental dump
(``docs/CHECKPOINTS.md``)."""

from dynamicemb.checkpoint.convert import convert_row_dtypes
from dynamicemb.checkpoint.dump import DynamicEmbDump
from dynamicemb.checkpoint.format import FORMAT_VERSION, CheckpointError, Manifest
from dynamicemb.checkpoint.incremental import incremental_dump
from dynamicemb.checkpoint.layout import current_version
from dynamicemb.checkpoint.load import DynamicEmbLoad

__all__ = [
    "CheckpointError",
    "DynamicEmbDump",
    "DynamicEmbLoad",
    "FORMAT_VERSION",
    "Manifest",
    "convert_row_dtypes",
    "current_version",
    "incremental_dump",
]
