"""A dense PyTorch reference of ``BatchedDynamicEmbeddingTables`` and test factories.

``DenseReference`` keeps every logical table as a Python dict ``id -> row`` (float32) plus
a dict ``id -> optimizer state``. For each batch it builds one dense matrix per table from
the dict, pools with ``torch.nn.functional.embedding_bag`` (or gathers rows for NONE),
gets the gradients with autograd on the dense matrices, and applies the optimizers with
the per-row formulas of ``torch.optim`` (SGD, Adagrad, Adam), lazily: only rows the batch
looked up move. Nothing here imports the implementation's kernels.

Factories: ``make_tables`` builds a module and its reference from one description,
``power_law_ids`` and ``random_batch`` draw TBE-layout batches, ``export_dict`` reads a
module's table into a dict comparable with the reference.
"""

import math
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from dynamicemb_testing import rounding_reference

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
    DynamicEmbWeightDecayMode,
)

OPTIMIZERS = [
    DynamicEmbOptimType.EXACT_SGD,
    DynamicEmbOptimType.EXACT_ADAGRAD,
    DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD,
    DynamicEmbOptimType.ADAM,
]
POOLINGS = [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE]
# One setting per optimizer for the tests (shared by the CPU and the CUDA suites).
OPTIMIZER_ARGS = {
    DynamicEmbOptimType.EXACT_SGD: DynamicEmbOptimizerArgs(DynamicEmbOptimType.EXACT_SGD, 0.1),
    DynamicEmbOptimType.EXACT_ADAGRAD: DynamicEmbOptimizerArgs(
        DynamicEmbOptimType.EXACT_ADAGRAD, 0.05, initial_accumulator_value=0.1),
    DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: DynamicEmbOptimizerArgs(
        DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.05, initial_accumulator_value=0.1),
    DynamicEmbOptimType.ADAM: DynamicEmbOptimizerArgs(DynamicEmbOptimType.ADAM, 0.01),
}

# Ids that stress a hash table keyed by raw int64: huge, negative, extremes, zero.
SPECIAL_IDS = [0, 1, -1, -7, 10**15, -(10**15), 2**62 + 3, 2**63 - 1, -(2**63), 99_999, 100_000]

RowFn = Callable[[int], torch.Tensor]


def state_dim(optimizer: DynamicEmbOptimType, dim: int) -> int:
    """Optimizer state floats per row, as ``export_keys_values`` lays them out."""
    return {
        DynamicEmbOptimType.EXACT_SGD: 0,
        DynamicEmbOptimType.EXACT_ADAGRAD: dim,  # sum of squares per element
        DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 1,  # sum of mean squares
        DynamicEmbOptimType.ADAM: 2 * dim,  # m then v
    }[optimizer]


def initial_state(args: DynamicEmbOptimizerArgs, dim: int) -> torch.Tensor:
    """State of a new (or imported without state) row."""
    n = state_dim(args.optimizer, dim)
    adagrad = args.optimizer in (DynamicEmbOptimType.EXACT_ADAGRAD,
                                 DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD)
    return torch.full((n,), args.initial_accumulator_value if adagrad else 0.0)


def initializer_row(args: DynamicEmbInitializerArgs, dim: int) -> RowFn:
    """The reference of the initializers that have a closed form (CONSTANT and DEBUG)."""
    if args.mode == DynamicEmbInitializerMode.CONSTANT:
        return lambda key: torch.full((dim,), float(args.value))
    if args.mode == DynamicEmbInitializerMode.DEBUG:
        return lambda key: torch.full((dim,), float(key % 100_000))  # Python %: non-negative
    raise ValueError(f"no closed-form reference for initializer {args.mode}")


# ----------------------------------------------------------------------------- optimizers
def apply_optimizer(
    args: DynamicEmbOptimizerArgs, lr: float, step: int, w: torch.Tensor, s: torch.Tensor,
    g: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One update of one row, float32, with torch.optim's formulas; weight decay L2
    (torch.optim's ``weight_decay``) or decoupled (``torch.optim.AdamW``: the row is
    scaled by ``1 - lr * weight_decay`` first), as ``args.decay_mode`` says.

    Args:
        args: optimizer settings (``lr`` given separately: schedulers change it).
        step: the Adam step (bias correction), counted from 1.
        w (Tensor): (dim,) row; s (Tensor): (state_dim,) state; g (Tensor): (dim,) the
            row's gradient summed over the batch.

    Returns:
        The new row and the new state.
    """
    w, s, g = w.clone(), s.clone(), g.clone()
    mode = args.decay_mode
    if mode == DynamicEmbWeightDecayMode.L2:
        g = g + args.weight_decay * w  # as torch.optim's weight_decay
    elif mode == DynamicEmbWeightDecayMode.DECOUPLE:
        w = w * (1 - lr * args.weight_decay)  # as torch.optim.AdamW
    kind = args.optimizer
    if kind == DynamicEmbOptimType.EXACT_SGD:
        w = w - lr * g
    elif kind == DynamicEmbOptimType.EXACT_ADAGRAD:
        s = s + g * g
        w = w - lr * g / (s.sqrt() + args.eps)
    elif kind == DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD:
        s = s + (g * g).mean()
        w = w - (lr / (s.sqrt() + args.eps)) * g
    elif kind == DynamicEmbOptimType.ADAM:
        dim = w.numel()
        m, v = s[:dim], s[dim:]
        m = torch.lerp(m, g, 1 - args.beta1)  # torch.optim.Adam's single-tensor path
        v = v * args.beta2 + (1 - args.beta2) * g * g
        step_size = lr / (1 - args.beta1 ** step)
        denom = v.sqrt() / math.sqrt(1 - args.beta2 ** step) + args.eps
        w = w + (-step_size) * (m / denom)
        s = torch.cat([m, v])
    else:  # pragma: no cover
        raise ValueError(kind)
    return w, s


# ----------------------------------------------------------------------------- reference
@dataclass
class RefTable:
    """One logical table of the reference."""

    dim: int
    optimizer: DynamicEmbOptimizerArgs
    init: Optional[RowFn] = None  # training initializer (None: unseen ids are an error)
    eval_init: Optional[RowFn] = None  # eval rows of unseen ids (None: zeros)
    rows: Dict[int, torch.Tensor] = field(default_factory=dict)
    states: Dict[int, torch.Tensor] = field(default_factory=dict)
    # 16-bit rows (``embedding_dtype``): rows hold values of ``row_dtype``, stored rounded
    # to nearest, updated in float32 and written back with ``rounding_reference``'s bits
    # (the table's ``stream``: the CRC-32 of its name) or to nearest
    row_dtype: torch.dtype = torch.float32
    stochastic: bool = True
    seed: int = 0
    stream: int = 0

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, dim) float32 rows as this table stores them (rounded to nearest)."""
        if self.row_dtype == torch.float32:
            return rows
        return rounding_reference.narrow_rn(rows.to(torch.float32), self.row_dtype).float()

    def written(self, key: int, row: torch.Tensor, step: int) -> torch.Tensor:
        """(dim,) an updated float32 row as the update at ``step`` writes it back."""
        if self.row_dtype == torch.float32:
            return row
        if not self.stochastic:
            return self.stored(row)
        keys = torch.tensor([key], dtype=torch.int64)
        return rounding_reference.stochastic_round(row[None], keys, self.seed, self.stream,
                                                   step, self.row_dtype)[0].float()


class DenseReference:
    """Dict tables, dense autograd math, lazy per-row optimizers.

    Args:
        tables: the logical tables.
        feature_table_map: table of each feature.
        pooling: SUM, MEAN or NONE.
    """

    def __init__(self, tables: Sequence[RefTable], feature_table_map: Sequence[int],
                 pooling: DynamicEmbPoolingMode) -> None:
        self.tables = list(tables)
        self.feature_table_map = list(feature_table_map)
        self.pooling = DynamicEmbPoolingMode(pooling)
        self.lrs = [t.optimizer.learning_rate for t in self.tables]
        self.step = 0  # backward calls: the Adam step
        self._pending = None

    # ------------------------------------------------------------------ rows
    def import_rows(self, table: int, keys: torch.Tensor, embeddings: torch.Tensor,
                    states: Optional[torch.Tensor] = None) -> None:
        t = self.tables[table]
        for i, key in enumerate(keys.tolist()):
            t.rows[key] = t.stored(embeddings[i].detach().to(torch.float32)[None])[0].clone()
            t.states[key] = (initial_state(t.optimizer, t.dim) if states is None
                             else states[i].detach().to(torch.float32).clone())

    def set_learning_rate(self, lr: float, table: Optional[int] = None) -> None:
        for i in range(len(self.tables)):
            if table is None or i == table:
                self.lrs[i] = lr

    # --------------------------------------------------------------- forward
    def _row(self, t: RefTable, key: int, training: bool) -> torch.Tensor:
        if key in t.rows:
            return t.rows[key]
        if training:
            if t.init is None:
                raise KeyError(f"reference has no row for {key} and no initializer")
            t.rows[key] = t.stored(t.init(key).to(torch.float32)[None])[0]
            t.states[key] = initial_state(t.optimizer, t.dim)
            return t.rows[key]
        row = t.eval_init(key) if t.eval_init is not None else torch.zeros(t.dim)
        return t.stored(row.to(torch.float32)[None])[0]

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                weights: Optional[torch.Tensor] = None, training: bool = True) -> torch.Tensor:
        """The module's output; in training remembers the batch for ``backward``."""
        indices, offsets = indices.long().tolist(), offsets.long()
        num_f = len(self.feature_table_map)
        batch = (offsets.numel() - 1) // num_f
        looked_up: Dict[int, Dict[int, int]] = {}  # table -> {key: row of its dense matrix}
        per_feature = []
        for f, table in enumerate(self.feature_table_map):
            lo = int(offsets[f * batch]) if batch else 0
            hi = int(offsets[(f + 1) * batch]) if batch else 0
            keys = indices[lo:hi]
            per_feature.append((lo, hi, keys))
            pos = looked_up.setdefault(table, {})
            for key in keys:
                pos.setdefault(key, len(pos))
        matrices = {}  # table -> (dense matrix (keys, dim), {key: row})
        for table, pos in looked_up.items():
            t = self.tables[table]
            rows = [self._row(t, k, training) for k in pos]  # inserts in training
            m = torch.stack(rows) if rows else torch.zeros(0, t.dim)
            matrices[table] = (m.clone().requires_grad_(training), pos)
        out = self._pool(matrices, per_feature, offsets, weights, batch)
        if training:
            self._pending = (out, matrices)
        return out.detach()

    def _pool(self, matrices, per_feature, offsets, weights, batch) -> torch.Tensor:
        if self.pooling == DynamicEmbPoolingMode.NONE:
            parts = []
            for f, (lo, hi, keys) in enumerate(per_feature):
                m, pos = matrices[self.feature_table_map[f]]
                idx = torch.tensor([pos[k] for k in keys], dtype=torch.int64)
                parts.append(F.embedding(idx, m))
            dim = self.tables[self.feature_table_map[0]].dim
            return torch.cat(parts) if parts else torch.zeros(0, dim)
        mode = "sum" if self.pooling == DynamicEmbPoolingMode.SUM else "mean"
        parts = []
        for f, (lo, hi, keys) in enumerate(per_feature):
            table = self.feature_table_map[f]
            m, pos = matrices[table]
            if batch == 0:
                parts.append(torch.zeros(0, self.tables[table].dim))
                continue
            idx = torch.tensor([pos[k] for k in keys], dtype=torch.int64)
            offs = offsets[f * batch:(f + 1) * batch + 1] - lo
            w = None if weights is None else weights[lo:hi].to(torch.float32)
            if m.shape[0] == 0:  # every bag of the table empty
                parts.append(torch.zeros(batch, self.tables[table].dim))
                continue
            parts.append(F.embedding_bag(idx, m, offs, mode=mode, per_sample_weights=w,
                                         include_last_offset=True))
        return torch.cat(parts, dim=1)

    # -------------------------------------------------------------- backward
    def backward(self, grad_output: torch.Tensor) -> None:
        """Gradients by autograd (from the output's gradient clamped to
        ``[-max_gradient, max_gradient]`` for tables with ``gradient_clipping``), then
        one optimizer update per looked-up row."""
        out, matrices = self._pending
        self._pending = None
        self.step += 1
        grads = {}
        for table, (m, _) in matrices.items():
            if not (m.numel() and out.requires_grad):
                continue
            opt = self.tables[table].optimizer
            g_out = grad_output.to(torch.float32)
            if opt.gradient_clipping:
                g_out = g_out.clamp(-opt.max_gradient, opt.max_gradient)
            g, = torch.autograd.grad(out, [m], g_out, allow_unused=True, retain_graph=True)
            grads[table] = torch.zeros_like(m) if g is None else g
        for table, (m, pos) in matrices.items():
            t = self.tables[table]
            for key, i in pos.items():
                row, t.states[key] = apply_optimizer(
                    t.optimizer, self.lrs[table], self.step, t.rows[key], t.states[key],
                    grads[table][i])
                t.rows[key] = t.written(key, row, self.step)

    def export(self, table: int) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
        t = self.tables[table]
        return {k: (t.rows[k], t.states[k]) for k in t.rows}


# ----------------------------------------------------------------------------- factories
@dataclass
class TableSpec:
    """What a test says about one table (turned into options for module and reference)."""

    dim: int
    max_capacity: int = 1024
    optimizer: Optional[DynamicEmbOptimizerArgs] = None  # per-table override
    init_value: float = 0.25  # CONSTANT training initializer
    bucket_capacity: int = 128
    options: dict = field(default_factory=dict)  # further DynamicEmbTableOptions fields


def make_tables(
    specs: Sequence[TableSpec],
    feature_table_map: Optional[Sequence[int]] = None,
    pooling: DynamicEmbPoolingMode = DynamicEmbPoolingMode.SUM,
    optimizer: DynamicEmbOptimizerArgs = DynamicEmbOptimizerArgs(),
    **module_kw,
) -> Tuple[BatchedDynamicEmbeddingTables, DenseReference]:
    """A module and its dense reference built from the same description."""
    ftm = list(feature_table_map) if feature_table_map is not None else list(range(len(specs)))
    options, ref_tables = [], []
    for spec in specs:
        init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT,
                                         value=spec.init_value)
        options.append(DynamicEmbTableOptions(
            dim=spec.dim, max_capacity=spec.max_capacity, bucket_capacity=spec.bucket_capacity,
            initializer_args=init, optimizer_args=spec.optimizer, **spec.options))
        ref_tables.append(RefTable(dim=spec.dim, optimizer=replace(spec.optimizer or optimizer),
                                   init=initializer_row(init, spec.dim)))
    module = BatchedDynamicEmbeddingTables(
        options, feature_table_map=ftm, pooling_mode=pooling, **asdict(optimizer), **module_kw)
    for t, o, name in zip(ref_tables, options, module.table_names):
        t.row_dtype, t.stochastic, t.seed = o.row_dtype, o.stochastic_rounding, o.rounding_seed
        t.stream = zlib.crc32(name.encode("utf-8"))
    return module, DenseReference(ref_tables, ftm, pooling)


def power_law_ids(pool: Sequence[int], n: int, generator: torch.Generator,
                  alpha: float = 1.2) -> torch.Tensor:
    """(n,) int64 ids drawn from ``pool`` with P(pool[r]) ~ 1 / (r + 1)^alpha: hot ids repeat."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    p = torch.arange(1, len(pool) + 1, dtype=torch.float64) ** -alpha
    pick = torch.multinomial(p, n, replacement=True, generator=generator)
    return torch.tensor(pool, dtype=torch.int64)[pick]


def id_pool(size: int, seed: int) -> List[int]:
    """``size`` distinct ids: the special ones first, then random int64 of every magnitude."""
    g = torch.Generator().manual_seed(seed)
    ids = list(dict.fromkeys(SPECIAL_IDS))
    while len(ids) < size:
        exp = int(torch.randint(1, 63, (1,), generator=g))
        v = int(torch.randint(0, 2**exp, (1,), generator=g)) * (1 if torch.rand(1, generator=g) < 0.5 else -1)
        if v not in ids:
            ids.append(v)
    perm = torch.randperm(len(ids), generator=g).tolist()
    return [ids[i] for i in perm][:size]


def random_batch(
    pools: Sequence[Sequence[int]], batch_size: int, generator: torch.Generator,
    max_bag: int = 4, weighted: bool = False, dtype: torch.dtype = torch.int64,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A TBE batch: one pool per feature; bag lengths in [0, max_bag] (empty bags occur).

    Returns:
        indices (N,), offsets (F * B + 1,), per-sample weights (N,) or None.
    """
    lengths = torch.randint(0, max_bag + 1, (len(pools), batch_size), generator=generator)
    parts = [power_law_ids(pool, int(lengths[f].sum()), generator) for f, pool in enumerate(pools)]
    indices = torch.cat(parts).to(dtype)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)]).to(dtype)
    weights = torch.rand(indices.numel(), generator=generator) * 2 - 0.5 if weighted else None
    return indices, offsets, weights


def export_dict(module: BatchedDynamicEmbeddingTables, name: str) -> Dict[int, tuple]:
    """key -> (embedding, optimizer state, score) of a module's table, on CPU."""
    ex = module.export_keys_values(name)
    embeddings, states = ex.embeddings.cpu().float(), ex.optimizer_states.cpu()
    return {k: (embeddings[i], states[i], int(score))
            for i, (k, score) in enumerate(zip(ex.keys.tolist(), ex.scores.tolist()))}


def snapshot(module: BatchedDynamicEmbeddingTables) -> Dict[str, Dict[int, tuple]]:
    """Everything exported by every table (for "unchanged" checks)."""
    return {name: {k: (e.tolist(), s.tolist(), sc) for k, (e, s, sc) in export_dict(module, name).items()}
            for name in module.table_names}


def assert_tables_match(module: BatchedDynamicEmbeddingTables, ref: DenseReference,
                        rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Same keys, rows and optimizer states in every table of module and reference."""
    for i, name in enumerate(module.table_names):
        got = export_dict(module, name)
        want = ref.export(i)
        assert sorted(got) == sorted(want), f"table {name}: keys differ"
        keys = sorted(want)
        if not keys:
            continue
        torch.testing.assert_close(torch.stack([got[k][0] for k in keys]),
                                   torch.stack([want[k][0] for k in keys]), rtol=rtol, atol=atol,
                                   msg=lambda m: f"table {name} embeddings: {m}")
        torch.testing.assert_close(torch.stack([got[k][1] for k in keys]),
                                   torch.stack([want[k][1] for k in keys]), rtol=rtol, atol=atol,
                                   msg=lambda m: f"table {name} optimizer states: {m}")
