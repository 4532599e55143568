"""``DynamicEmbDump``: every dynamic table of a model into a checkpoint directory."""

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch import nn

from dynamicemb.checkpoint._collective import Collective
from dynamicemb.checkpoint._progress import Progress
from dynamicemb.checkpoint.format import (EMBEDDING_FILE_DTYPES, FIELD_DTYPES, CheckpointError,
                                          FieldWriter, Manifest, ShardEntry, TableEntry,
                                          field_file_name, jsonable)
from dynamicemb.checkpoint.layout import MANIFEST, begin_version, commit_version, discard
from dynamicemb.checkpoint.tables import LocalTable, local_tables, pending_updates, table_name_list
from dynamicemb.ops.interface import RowFormat
from dynamicemb.placement import placement_record
from dynamicemb.types import ROW_DTYPE_NAMES

__all__ = ["DynamicEmbDump"]

#: Bytes of rows exported and written per chunk (bounded extra memory).
CHUNK_BYTES = 32 << 20


def DynamicEmbDump(  # noqa: N802 (upstream dynamicemb's name)
    path: str,
    model: nn.Module,
    table_names: Optional[Sequence[str]] = None,
    optim: bool = True,
    counter: bool = True,
    pg: Optional[dist.ProcessGroup] = None,
    allow_overwrite: bool = False,
) -> str:
    """Writes every dynamic table of ``model`` to the checkpoint directory ``path``.

    A collective over ``pg``. Each rank writes the rows it holds (keys, embeddings in
    the table's dtype, optimizer states, scores, admission counters) into a new
    version, and the manifest records each table's dtype; rank 0 then
    switches ``path`` to it atomically: a dump killed at any point leaves the previous
    checkpoint as it was (``docs/CHECKPOINTS.md``).

    Args:
        path: the checkpoint directory, seen by every rank.
        model: a DMP-sharded model, or any module containing
            ``BatchedDynamicEmbeddingTables``.
        table_names: only these tables, as names or upstream's ``{collection path:
            names}`` (default: every dynamic table).
        optim, counter: also save optimizer states, admission counters.
        pg: the ranks holding the model (default: the default group, or this
            process alone when torch.distributed is not initialized).
        allow_overwrite: replace a checkpoint already at ``path``.

    Returns:
        The new version directory (holding ``manifest.json``).

    Raises:
        CheckpointError: on every rank, if any rank fails (nothing is replaced).

    Example::

        DynamicEmbDump("/ckpt/dynamic", model, allow_overwrite=True)
    """
    table_names = table_name_list(table_names)
    for pending in pending_updates(model):  # owner rows only, with nothing pending
        pending.flush_pending()
    group = Collective(pg)
    tables, error = {}, None
    try:
        tables = local_tables(model, table_names)
    except ValueError as err:
        error = f"rank {group.rank}: {err}"
    group.agree(error)
    group.agree(_check_tables(group.all_gather({n: t.sharding for n, t in tables.items()}),
                              table_names))
    tmp, error = None, None
    if group.rank == 0:
        try:
            tmp = begin_version(path, allow_overwrite)
        except (CheckpointError, OSError) as err:
            error = str(err)
    group.agree(error)
    tmp = group.broadcast(tmp)
    try:
        written, error = {}, None
        try:
            written = _write_rank(tmp, tables, group.rank, optim, counter)
        except Exception as err:  # reported on every rank by agree()
            error = f"rank {group.rank}: writing {tmp}: {err!r}"
        group.agree(error)
        gathered = group.all_gather(written)
        version, error = None, None
        if group.rank == 0:
            try:
                version = _commit(path, tmp, gathered, group.world_size)
            except (CheckpointError, OSError) as err:
                error = f"committing {path}: {err}"
        group.agree(error)
    except Exception:  # a failure, not a crash: the temporary version goes
        if group.rank == 0:
            discard(tmp)
        raise
    return group.broadcast(version)


def _check_tables(per_rank: List[Dict[str, str]],
                  table_names: Optional[Sequence[str]]) -> Optional[str]:
    """What is wrong with the tables the ranks hold, or None."""
    holders: Dict[str, List[int]] = {}
    for rank, names in enumerate(per_rank):
        for name, sharding in names.items():
            holders.setdefault(name, []).append(rank)
            if sharding != "row_wise" and len(holders[name]) > 1:
                return (f"table {name!r} is stored whole ({sharding}) on ranks "
                        f"{holders[name]}: a checkpoint holds one copy of each row")
    if table_names is not None:
        missing = sorted(set(table_names) - set(holders))
        if missing:
            return f"no dynamic table named {missing} in the model"
    if not holders:
        return "the model has no dynamic tables to dump"
    return None


def _write_rank(directory: str, tables: Dict[str, LocalTable], rank: int, optim: bool,
                counter: bool) -> Dict[str, Tuple[TableEntry, ShardEntry]]:
    """Writes this rank's rows of every table; returns their manifest entries."""
    for module in {id(t.module): t.module for t in tables.values()}.values():
        module.flush()
    total = sum(_row_bytes(t, optim) * t.module.table_size(t.name) for t in tables.values())
    progress = Progress("dump", total, show=rank == 0)
    try:
        return {name: _write_table(directory, table, rank, optim, counter, progress)
                for name, table in sorted(tables.items())}
    finally:
        progress.close()


def _row_format(table: LocalTable, optim: bool) -> RowFormat:
    """The layout of the table's rows with the states the dump saves."""
    module = table.module
    options = module.table_options[module.table_names.index(table.name)]
    state_dim = module.optimizer_state_dim(table.name) if optim else 0
    return RowFormat(options.row_dtype, options.dim, state_dim)


def _row_bytes(table: LocalTable, optim: bool) -> int:
    """Bytes a row takes in the field files (the progress bar's unit): key, score,
    embedding (in the table's dtype) and states, unpadded."""
    fmt = _row_format(table, optim)
    return 16 + fmt.scale_offset + 4 * fmt.state_dim


def _write_table(directory: str, table: LocalTable, rank: int, optim: bool, counter: bool,
                 progress: Progress) -> Tuple[TableEntry, ShardEntry]:
    module, name = table.module, table.name
    options = module.table_options[module.table_names.index(name)]
    state_dim = module.optimizer_state_dim(name) if optim else 0
    dtype = ROW_DTYPE_NAMES[options.row_dtype]
    columns = {"keys": 0, "embeddings": options.dim, "scores": 0}
    if state_dim:
        columns["optimizer_states"] = state_dim
    file_dtypes = dict(FIELD_DTYPES, embeddings=EMBEDDING_FILE_DTYPES[dtype])
    writers = {f: FieldWriter(directory, field_file_name(name, rank, f), file_dtypes[f], c)
               for f, c in columns.items()}
    try:
        row_bytes = _row_bytes(table, optim)
        for rows in module.iter_keys_values(name, max(1024, CHUNK_BYTES // row_bytes)):
            for f, writer in writers.items():
                writer.write(getattr(rows, f))
            progress.update(rows.keys.numel() * row_bytes)
        with_counters = counter and options.admit_strategy is not None
        if with_counters:
            writers.update(_write_counters(directory, module, name, rank))
        files = {f: w.close() for f, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    clocks = module.table_clocks(name)
    shard = ShardEntry(rank=rank, rows=files["keys"].shape[0],
                       counter_rows=files["counter_keys"].shape[0] if with_counters else 0,
                       optimizer_step=clocks.optimizer_step, score_clock=clocks.score_clock,
                       admission_clock=clocks.admission_clock, train_steps=module.train_steps,
                       files=files)
    entry = TableEntry(dim=options.dim, state_dim=state_dim,
                       optimizer=jsonable(module.optimizer_args(name)),
                       score_strategy=options.score_strategy.value, options=jsonable(options),
                       sharding=table.sharding, num_shards=table.num_shards, rows=shard.rows,
                       optim=optim, counter=with_counters, dist_type=table.dist_type.value,
                       placement=placement_record(table.placement), embedding_dtype=dtype)
    return entry, shard


def _write_counters(directory: str, module, name: str, rank: int) -> Dict[str, FieldWriter]:
    counters = module.export_admission_counters(name)
    writers = {}
    for f, tensor in (("counter_keys", counters.keys), ("counter_counts", counters.counts),
                      ("counter_scores", counters.scores)):
        writers[f] = FieldWriter(directory, field_file_name(name, rank, f), FIELD_DTYPES[f], 0)
        writers[f].write(tensor)
    return writers


def _commit(path: str, tmp: str, gathered: List[Dict[str, Tuple[TableEntry, ShardEntry]]],
            world_size: int) -> str:
    """Rank 0: writes the manifest, then switches to the version."""
    tables: Dict[str, TableEntry] = {}
    for per_rank in gathered:
        for name, (entry, shard) in per_rank.items():
            merged = tables.setdefault(name, entry)
            if merged is not entry:
                if (merged.dim, merged.state_dim, merged.embedding_dtype) != (
                        entry.dim, entry.state_dim, entry.embedding_dtype):
                    raise CheckpointError(f"table {name!r} has different dims or dtypes on "
                                          f"different ranks")
                merged.rows += shard.rows
            merged.shards.append(shard)
    manifest = Manifest(world_size=world_size, tables=tables)
    manifest_path = os.path.join(tmp, MANIFEST)
    with open(manifest_path, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    return commit_version(path, tmp)
