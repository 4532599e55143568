"""``DynamicEmbLoad``: a checkpoint into a model's dynamic tables, resharding on the way."""

import os
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist
from torch import nn

from dynamicemb.checkpoint._collective import Collective
from dynamicemb.checkpoint._progress import Progress
from dynamicemb.checkpoint.format import (CheckpointError, FieldReader, Manifest, ShardEntry,
                                          TableEntry, verify_file)
from dynamicemb.checkpoint.layout import MANIFEST, current_version
from dynamicemb.checkpoint.tables import LocalTable, local_tables, pending_updates, table_name_list
from dynamicemb.embedding import TableClocks
from dynamicemb.types import ROW_DTYPE_NAMES

__all__ = ["DynamicEmbLoad"]

#: Rows read per chunk of a shard's files (bounded extra memory).
CHUNK_ROWS = 1 << 16

_ROW_FIELDS = ("keys", "embeddings", "scores")
_COUNTER_FIELDS = ("counter_keys", "counter_counts", "counter_scores")


def DynamicEmbLoad(  # noqa: N802 (upstream dynamicemb's name)
    path: str,
    model: nn.Module,
    table_names: Optional[Sequence[str]] = None,
    optim: bool = True,
    counter: bool = True,
    pg: Optional[dist.ProcessGroup] = None,
    *,
    merge: bool = False,
    convert_dtype: bool = False,
) -> None:
    """Loads the checkpoint at ``path`` into the dynamic tables of ``model``.

    A collective over ``pg``. Every table must match its save (dim, score strategy,
    embedding dtype unless ``convert_dtype``, with ``optim`` the optimizer) and every
    file its size and checksum on every rank before any table changes. Each rank keeps
    the saved rows its placement gives it: any saved world size, sharding and
    ``dist_type`` loads into any other. Scores,
    optimizer steps, clocks and ``train_steps`` are restored; device caches start empty.

    Args:
        path: the checkpoint directory written by ``DynamicEmbDump``.
        model: the model to fill (sharded or not).
        table_names: only these tables, as names or upstream's ``{collection path:
            names}`` (default: every dynamic table of the model, all of which must be
            in the checkpoint).
        optim: load optimizer states and steps; False loads rows with fresh states
            (and optimizer step 0 unless merging).
        counter: load admission counters.
        pg: the ranks holding the model (see ``DynamicEmbDump``).
        merge: keep the tables' current rows and write the saved ones over them
            (clocks become the larger of both); default: replace the contents.
        convert_dtype: load rows saved in another embedding dtype, rounded to nearest
            (even) into the table's (float16/bfloat16 into float32: exact); default:
            refuse them, naming both dtypes. Optimizer states are float32 in every
            table and load unchanged.

    Raises:
        CheckpointError: on every rank, no table changed: no checkpoint, another format
            version, a mismatch with the model, or a damaged file (named).
    """
    table_names = table_name_list(table_names)
    group = Collective(pg)
    tables: Dict[str, LocalTable] = {}
    error = version = manifest = None
    try:
        version = current_version(path)
        manifest = Manifest.read(os.path.join(version, MANIFEST))
        tables = local_tables(model, table_names)
        _check_compatible(manifest, tables, table_names, optim, convert_dtype)
        error = _verify_files(version, manifest, tables, optim, counter)
    except (CheckpointError, ValueError, OSError) as err:
        error = str(err)
    group.agree(f"rank {group.rank}: {error}" if error else None)
    if table_names is not None:
        held = set().union(*group.all_gather(set(tables)))
        missing = sorted(set(table_names) - held)
        group.agree(f"no dynamic table named {missing} in the model" if missing else None)
    for pending in pending_updates(model):  # copies of the rows being replaced
        pending.drop_pending()
    error = None
    try:
        _load_rank(version, manifest, tables, optim, counter, merge, group.rank)
    except Exception as err:  # reported on every rank
        error = f"rank {group.rank}: loading {version}: {err!r}"
    group.agree(error)


def _check_compatible(manifest: Manifest, tables: Dict[str, LocalTable],
                      table_names: Optional[Sequence[str]], optim: bool,
                      convert_dtype: bool) -> None:
    """Raises ``CheckpointError`` saying how a table differs from its save."""
    missing = sorted(set(table_names or ()) - set(manifest.tables))
    missing += sorted(n for n in tables if n not in manifest.tables and n not in missing)
    if missing:
        raise CheckpointError(f"the checkpoint has no table {missing} "
                              f"(it holds {sorted(manifest.tables)})")
    for name, table in tables.items():
        saved = manifest.tables[name]
        module = table.module
        options = module.table_options[module.table_names.index(name)]
        differences = []
        if saved.dim != options.dim:
            differences.append(f"dim {saved.dim} saved, {options.dim} in the model")
        dtype = ROW_DTYPE_NAMES[options.row_dtype]
        if saved.embedding_dtype != dtype and not convert_dtype:
            differences.append(f"embedding dtype {saved.embedding_dtype} saved, {dtype} in the "
                               f"model (pass convert_dtype=True to round the saved rows to "
                               f"nearest {dtype})")
        if saved.score_strategy != options.score_strategy.value:
            differences.append(f"score strategy {saved.score_strategy} saved, "
                               f"{options.score_strategy.value} in the model")
        optimizer = module.optimizer_args(name).optimizer.value
        if optim and saved.optimizer["optimizer"] != optimizer:
            differences.append(f"optimizer {saved.optimizer['optimizer']} saved, {optimizer} "
                               f"in the model (load with optim=False for fresh states)")
        elif optim and saved.state_dim != module.optimizer_state_dim(name):
            differences.append(f"{saved.state_dim} optimizer-state columns saved, "
                               f"{module.optimizer_state_dim(name)} in the model "
                               f"(saved without states? load with optim=False)")
        if differences:
            raise CheckpointError(f"table {name!r}: " + "; ".join(differences))


def _fields(entry: TableEntry, table: LocalTable, optim: bool, counter: bool) -> List[str]:
    """The field files a rank reads for one table."""
    fields = list(_ROW_FIELDS)
    if optim and entry.state_dim:
        fields.append("optimizer_states")
    if counter and entry.counter and _has_admission(table):
        fields += _COUNTER_FIELDS
    return fields


def _has_admission(table: LocalTable) -> bool:
    module = table.module
    return module.table_options[module.table_names.index(table.name)].admit_strategy is not None


def _verify_files(version: str, manifest: Manifest, tables: Dict[str, LocalTable], optim: bool,
                  counter: bool) -> Optional[str]:
    """None if every file this rank will read is whole; else the first problem."""
    for name, table in sorted(tables.items()):
        entry = manifest.tables[name]
        for shard in entry.shards:
            for field_name in _fields(entry, table, optim, counter):
                if field_name not in shard.files:
                    return f"{version}: table {name!r} rank {shard.rank} has no {field_name} file"
                problem = verify_file(version, shard.files[field_name])
                if problem:
                    return problem
    return None


def _load_rank(version: str, manifest: Manifest, tables: Dict[str, LocalTable], optim: bool,
               counter: bool, merge: bool, rank: int) -> None:
    """Empties this rank's tables (unless merging), imports its rows, restores clocks."""
    modules = {id(t.module): t.module for t in tables.values()}
    for module in modules.values():
        module.reset_cache_states()
    total = sum(f.bytes for name, t in tables.items() for s in manifest.tables[name].shards
                for key, f in s.files.items() if key in _fields(manifest.tables[name], t, optim, counter))
    progress = Progress("load", total, show=rank == 0)
    train_steps = {key: (m.train_steps if merge else 0) for key, m in modules.items()}
    try:
        for name, table in sorted(tables.items()):
            entry = manifest.tables[name]
            if not merge:
                table.module.clear_table(name)
            fields = _fields(entry, table, optim, counter)
            for shard in entry.shards:
                _import_rows(version, table, shard, fields, progress)
                if "counter_keys" in fields:
                    _import_counters(version, table, shard)
            _restore_clocks(table, entry.shards, optim, merge)
            key = id(table.module)
            train_steps[key] = max([train_steps[key]] + [s.train_steps for s in entry.shards])
    finally:
        progress.close()
    for key, module in modules.items():
        module.set_train_steps(train_steps[key])


def _import_rows(version: str, table: LocalTable, shard: ShardEntry, fields: List[str],
                 progress: Progress) -> None:
    """Imports the rows of one saved shard that this rank owns, chunk by chunk."""
    readers = {f: FieldReader(version, shard.files[f])
               for f in fields if f not in _COUNTER_FIELDS}
    try:
        for _ in range(0, shard.rows, CHUNK_ROWS):
            chunk = {f: r.read(CHUNK_ROWS) for f, r in readers.items()}
            progress.update(sum(t.numel() * t.element_size() for t in chunk.values()))
            mine = table.owns(chunk["keys"]).nonzero().squeeze(1)
            if mine.numel() == 0:
                continue
            states = chunk.get("optimizer_states")
            table.module.import_keys_values(
                table.name, chunk["keys"][mine], chunk["embeddings"][mine],
                None if states is None else states[mine], scores=chunk["scores"][mine])
    finally:
        for r in readers.values():
            r.close()


def _import_counters(version: str, table: LocalTable, shard: ShardEntry) -> None:
    """Imports the admission counters of one saved shard that this rank owns."""
    saved = {}
    for f in _COUNTER_FIELDS:
        reader = FieldReader(version, shard.files[f])
        try:
            saved[f] = reader.read(shard.counter_rows)
        finally:
            reader.close()
    mine = table.owns(saved["counter_keys"]).nonzero().squeeze(1)
    if mine.numel():
        table.module.import_admission_counters(
            table.name, saved["counter_keys"][mine], saved["counter_counts"][mine],
            saved["counter_scores"][mine])


def _restore_clocks(table: LocalTable, shards: List[ShardEntry], optim: bool,
                    merge: bool) -> None:
    """Sets the largest saved clocks of the table's shards (with ``merge``, at least its own)."""
    current = table.module.table_clocks(table.name)
    floor = current if merge else TableClocks(0, 0, 0)
    saved = TableClocks(
        optimizer_step=max(s.optimizer_step for s in shards) if optim else 0,
        score_clock=max(s.score_clock for s in shards),
        admission_clock=max(s.admission_clock for s in shards),
    )
    table.module.set_table_clocks(table.name, TableClocks(*(max(a, b) for a, b in zip(floor, saved))))
