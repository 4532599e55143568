"""A ``BatchedDynamicEmbeddingTables``'s contents as ``state_dict`` extra state: everything a
resume needs, as tensors and plain data (``torch.load(..., weights_only=True)`` reads it)."""

from typing import Any, Dict, List, Tuple

import torch

from dynamicemb.embedding.records import TableClocks
from dynamicemb.ops.interface import RowFormat
from dynamicemb.types import ROW_DTYPE_NAMES

__all__ = ["EXTRA_STATE_FORMAT", "IMPORT_CHUNK_ROWS", "check_table_state", "convert_tables_state",
           "load_tables_state", "table_header", "tables_state"]

#: ``format`` of the extra state; ``version`` 1 is the only one.
EXTRA_STATE_FORMAT = "dynamicemb-tables"
#: Rows imported per call while loading (bounded extra memory).
IMPORT_CHUNK_ROWS = 1 << 16

#: The row fields and their dtypes (None: the table's row dtype).
_ROW_FIELDS: Tuple[Tuple[str, Any], ...] = (
    ("keys", torch.int64), ("embeddings", None),
    ("optimizer_states", torch.float32), ("scores", torch.int64))
_COUNTER_FIELDS: Tuple[Tuple[str, torch.dtype], ...] = (
    ("counter_keys", torch.int64), ("counter_counts", torch.float64),
    ("counter_scores", torch.int64))
#: Header values of states saved before the header had their key.
_HEADER_DEFAULTS = {"embedding_dtype": "float32"}


def table_header(module, name: str) -> Dict[str, Any]:
    """What a table's saved rows must agree with: dim, optimizer-state columns,
    optimizer, score strategy and the embeddings' dtype (``ROW_DTYPE_NAMES``; plain
    data)."""
    options = module.table_options[module.table_names.index(name)]
    return {"dim": options.dim, "state_dim": module.optimizer_state_dim(name),
            "optimizer": module.optimizer_args(name).optimizer.value,
            "score_strategy": options.score_strategy.value,
            "embedding_dtype": ROW_DTYPE_NAMES[options.row_dtype]}


def _row_dtype(module, name: str) -> torch.dtype:
    return module.table_options[module.table_names.index(name)].row_dtype


def _export_rows(module, name: str) -> Dict[str, torch.Tensor]:
    """Every row of a table, in tensors allocated once at their final size."""
    header = table_header(module, name)
    n = module.table_size(name)
    out = {"keys": torch.empty(n, dtype=torch.int64),
           "embeddings": torch.empty(n, header["dim"], dtype=_row_dtype(module, name)),
           "optimizer_states": torch.empty(n, header["state_dim"]),
           "scores": torch.empty(n, dtype=torch.int64)}
    filled = 0
    for rows in module.iter_keys_values(name):
        count = rows.keys.numel()
        for field, _ in _ROW_FIELDS:
            out[field][filled:filled + count] = getattr(rows, field)
        filled += count
    if filled != n:
        raise RuntimeError(f"table {name!r} changed while it was exported ({n} rows, then {filled})")
    return out


def table_state(module, name: str) -> Dict[str, Any]:
    """One table's rows, counters, clocks and header (CPU tensors and plain data).

    Shape:
        keys (n,) int64; embeddings (n, dim) in the table's dtype; optimizer_states
        (n, state_dim) float32; scores (n,) int64; counter_keys/counter_counts/
        counter_scores (m,) int64/float64/int64; clocks (3,) int64 (``TableClocks``
        order).
    """
    state = table_header(module, name)
    state.update(_export_rows(module, name))
    counters = module.export_admission_counters(name)
    state.update({"counter_keys": counters.keys.cpu(), "counter_counts": counters.counts.cpu(),
                  "counter_scores": counters.scores.cpu()})
    state["clocks"] = torch.tensor(list(module.table_clocks(name)), dtype=torch.int64)
    return state


def tables_state(module) -> Dict[str, Any]:
    """The extra state of a module: every table (device caches are flushed first)."""
    module.flush()
    return {"format": EXTRA_STATE_FORMAT, "version": 1, "train_steps": module.train_steps,
            "tables": {name: table_state(module, name) for name in module.table_names}}


def _check_tensor(name: str, field: str, value: Any, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != shape:
        got = (f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise ValueError(f"table {name!r}: state field {field!r} must be {dtype} of shape "
                         f"{shape}, got {got}")


def check_table_state(module, name: str, state: Any) -> None:
    """Raises ``ValueError`` saying what differs between a table and its saved state."""
    if not isinstance(state, dict):
        raise ValueError(f"table {name!r}: saved state must be a dict, got {type(state).__name__}")
    header = table_header(module, name)
    differences = [f"{key} {_saved(state, key)!r} saved, {value!r} in the module"
                   for key, value in header.items() if _saved(state, key) != value]
    if _saved(state, "embedding_dtype") != header["embedding_dtype"]:
        differences.append("convert the rows with dynamicemb.convert_row_dtypes(state_dict, "
                           "model)")
    if differences:
        raise ValueError(f"table {name!r}: " + "; ".join(differences))
    n = state["keys"].shape[0] if isinstance(state.get("keys"), torch.Tensor) else -1
    columns = {"keys": (), "embeddings": (header["dim"],),
               "optimizer_states": (header["state_dim"],), "scores": ()}
    for field, dtype in _ROW_FIELDS:
        _check_tensor(name, field, state.get(field), dtype or _row_dtype(module, name),
                      (n,) + columns[field])
    m = state["counter_keys"].shape[0] if isinstance(state.get("counter_keys"), torch.Tensor) else -1
    for field, dtype in _COUNTER_FIELDS:
        _check_tensor(name, field, state.get(field), dtype, (m,))
    _check_tensor(name, "clocks", state.get("clocks"), torch.int64, (3,))
    if (n and int(state["scores"].min()) < 0) or int(state["clocks"].min()) < 0:
        raise ValueError(f"table {name!r}: saved scores and clocks must be >= 0")
    if m and not _has_admission(module, name):
        raise ValueError(f"table {name!r}: {m} admission counters saved, but the module's "
                         f"table has no admission strategy")


def _saved(state: Dict[str, Any], key: str) -> Any:
    """A header value of a saved table state (states saved before a key have its
    default)."""
    return state.get(key, _HEADER_DEFAULTS.get(key))


def _has_admission(module, name: str) -> bool:
    return module.table_options[module.table_names.index(name)].admit_strategy is not None


def _check_state(module, state: Any) -> None:
    """The whole extra state against the module (nothing changes before it passes)."""
    if not isinstance(state, dict) or state.get("format") != EXTRA_STATE_FORMAT:
        raise ValueError("not a dynamicemb table state (expected the extra state that "
                         "BatchedDynamicEmbeddingTables.state_dict() writes)")
    if state.get("version") != 1:
        raise ValueError(f"dynamicemb table state version {state.get('version')!r}; "
                         f"this version reads 1")
    tables = state.get("tables")
    saved: List[str] = sorted(tables) if isinstance(tables, dict) else []
    if saved != sorted(module.table_names):
        raise ValueError(f"the state dict holds dynamic tables {saved}, the module "
                         f"{sorted(module.table_names)}; load a subset with "
                         f"DynamicEmbLoad(table_names=...)")
    if not isinstance(state.get("train_steps"), int) or state["train_steps"] < 0:
        raise ValueError(f"train_steps must be an int >= 0, got {state.get('train_steps')!r}")
    for name in module.table_names:
        check_table_state(module, name, tables[name])


def convert_tables_state(module, state: Any) -> Any:
    """``state`` (a ``tables_state``) with each table's rows in the module's table's
    dtype: embeddings rounded to nearest (even) as ``import_keys_values`` rounds them
    (16 bits into float32: exact), the header naming that dtype. Tables already in
    their dtype, tables the module lacks and fields that disagree with their header
    are left as they are (``load_tables_state`` refuses what is wrong). A new dict;
    ``state`` is unchanged."""
    if not isinstance(state, dict) or not isinstance(state.get("tables"), dict):
        return state
    tables = dict(state["tables"])
    for name, saved in state["tables"].items():
        if name not in module.table_names or not isinstance(saved, dict):
            continue
        dtype, embeddings = _row_dtype(module, name), saved.get("embeddings")
        named = ROW_DTYPE_NAMES.get(getattr(embeddings, "dtype", None))
        if (named is None or named != _saved(saved, "embedding_dtype") or embeddings.dim() != 2
                or embeddings.shape[1] != module.dims[module.table_names.index(name)]
                or named == ROW_DTYPE_NAMES[dtype]):
            continue
        fmt = RowFormat(dtype, embeddings.shape[1], 0)
        tables[name] = dict(saved, embeddings=fmt.embeddings(fmt.pack(embeddings)).contiguous(),
                            embedding_dtype=ROW_DTYPE_NAMES[dtype])
    return dict(state, tables=tables)


def load_table_state(module, name: str, state: Dict[str, Any]) -> None:
    """Replaces one table's rows, counters and clocks with a checked saved state
    (rows imported ``IMPORT_CHUNK_ROWS`` at a time)."""
    module.clear_table(name)
    n = state["keys"].shape[0]
    for start in range(0, n, IMPORT_CHUNK_ROWS):
        part = slice(start, start + IMPORT_CHUNK_ROWS)
        module.import_keys_values(name, state["keys"][part], state["embeddings"][part],
                                  state["optimizer_states"][part], scores=state["scores"][part])
    if state["counter_keys"].numel():
        module.import_admission_counters(name, state["counter_keys"], state["counter_counts"],
                                         state["counter_scores"])
    module.set_table_clocks(name, TableClocks(*(int(c) for c in state["clocks"])))


def load_tables_state(module, state: Any) -> None:
    """Restores ``tables_state``: checks everything, then replaces each table's
    contents, clocks and ``train_steps``; device caches start empty.

    Raises:
        ValueError: the state is not this module's (other tables, dims, optimizer,
            score strategy, malformed fields); no table has changed.
    """
    _check_state(module, state)
    module.reset_cache_states()
    for name in module.table_names:
        load_table_state(module, name, state["tables"][name])
    module.set_train_steps(state["train_steps"])
