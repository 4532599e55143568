"""Frozen rows (keys and embeddings only) from a ``DynamicEmbDump`` checkpoint of any
world size and sharding."""

import os
from typing import Dict, Optional, Sequence, Tuple

import torch

from dynamicemb.checkpoint.format import CheckpointError, FieldReader, Manifest, verify_file
from dynamicemb.checkpoint.layout import MANIFEST, current_version
from dynamicemb.options import DynamicEmbInitializerArgs, DynamicEmbInitializerMode

__all__ = ["read_rows", "saved_eval_initializer"]

_FIELDS = ("keys", "embeddings")


def read_rows(path: str, table_names: Optional[Sequence[str]] = None
              ) -> Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Manifest]:
    """Every saved row of ``table_names`` (default: all) of the checkpoint at ``path``.

    Returns:
        (table name -> (keys (n,) int64, embeddings (n, dim) float32), manifest).

    Raises:
        CheckpointError: no checkpoint, a table it lacks, or a damaged file (named).
    """
    version = current_version(path)
    manifest = Manifest.read(os.path.join(version, MANIFEST))
    names = list(manifest.tables) if table_names is None else list(table_names)
    missing = sorted(set(names) - set(manifest.tables))
    if missing:
        raise CheckpointError(f"the checkpoint at {path} has no table {missing} "
                              f"(it holds {sorted(manifest.tables)})")
    for name in names:
        for shard in manifest.tables[name].shards:
            for field_name in _FIELDS:
                if field_name not in shard.files:
                    raise CheckpointError(f"{version}: table {name!r} rank {shard.rank} has "
                                          f"no {field_name} file")
                problem = verify_file(version, shard.files[field_name])
                if problem:
                    raise CheckpointError(problem)
    rows = {}
    for name in names:
        entry = manifest.tables[name]
        parts = [tuple(_read_field(version, shard.files[f], shard.rows) for f in _FIELDS)
                 for shard in entry.shards]
        keys = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
        embeddings = torch.cat([p[1] for p in parts]) if parts else torch.empty(0, entry.dim)
        rows[name] = (keys.to(torch.int64), embeddings.to(torch.float32))
    return rows, manifest


def _read_field(version: str, entry, rows: int) -> torch.Tensor:
    reader = FieldReader(version, entry)
    try:
        return reader.read(rows).clone()
    finally:
        reader.close()


def saved_eval_initializer(manifest: Manifest, name: str) -> DynamicEmbInitializerArgs:
    """The eval initializer a table was saved with (its options in the manifest)."""
    saved = dict(manifest.tables[name].options.get("eval_initializer_args") or {})
    if not saved:
        return DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.0)
    saved["mode"] = DynamicEmbInitializerMode(saved["mode"])
    return DynamicEmbInitializerArgs(**saved)
