"""TorchRec-facing inference twins: ``EmbeddingCollection`` and ``EmbeddingBagCollection``
with frozen rows."""

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from dynamicemb.inference.checkpoint import read_rows, saved_eval_initializer
from dynamicemb.inference.module import InferenceEmbeddingTables, Rows
from dynamicemb.options import DynamicEmbInitializerArgs, DynamicEmbPoolingMode, DynamicEmbTableOptions

__all__ = ["InferenceEmbeddingBagCollection", "InferenceEmbeddingCollection", "collection_twin"]

_POOLING = {PoolingType.SUM: DynamicEmbPoolingMode.SUM, PoolingType.MEAN: DynamicEmbPoolingMode.MEAN}


def _options(config, eval_init: Optional[DynamicEmbInitializerArgs]) -> DynamicEmbTableOptions:
    options = DynamicEmbTableOptions(dim=config.embedding_dim, max_capacity=config.num_embeddings)
    if eval_init is not None:
        options.eval_initializer_args = eval_init
    return options


def _lengths(features: KeyedJaggedTensor, names: Sequence[str]) -> List[torch.Tensor]:
    """Each named feature's (B,) lengths; views when the KJT holds exactly these
    features in order (TorchRec's per-key split would put an FBGEMM op in the export)."""
    if list(features.keys()) == list(names):
        return list(features.lengths().view(len(names), -1).unbind(0))
    return [features[f].lengths() for f in names]


def _sizes(lengths: List[torch.Tensor], total) -> List[int]:
    """Ids per feature, as data-dependent sizes ``torch.export`` accepts."""
    sizes = [n.sum().item() for n in lengths]
    for size in sizes:
        torch._check_is_size(size)
    torch._check(sum(sizes) == total)
    return sizes


def _batch(features: KeyedJaggedTensor, names: Sequence[str]) -> Tuple[torch.Tensor, ...]:
    """(indices, offsets, weights or None) of the named features, feature-major."""
    if list(features.keys()) == list(names):
        lengths = features.lengths()
        values, weights = features.values(), features.weights_or_none()
    else:
        jts = [features[f] for f in names]
        lengths = torch.cat([jt.lengths() for jt in jts])
        values = torch.cat([jt.values() for jt in jts])
        weights = None if jts[0].weights_or_none() is None else torch.cat(
            [jt.weights() for jt in jts])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return values, offsets, weights


class InferenceEmbeddingBagCollection(nn.Module):
    """A frozen ``EmbeddingBagCollection``: ``forward(KeyedJaggedTensor) -> KeyedTensor``
    (one group of tables per pooling, SUM or MEAN; outputs in the collection's order).

    Args:
        tables: the collection's ``EmbeddingBagConfig``s.
        rows: table name -> (keys (n,) int64, embeddings (n, dim)) for every table.
        eval_initializers: table name -> the row unseen ids get (default zeros).
        dtype, device: as ``InferenceEmbeddingTables``'.
    """

    def __init__(self, tables: List[EmbeddingBagConfig], rows: Rows,
                 eval_initializers: Optional[Mapping[str, DynamicEmbInitializerArgs]] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None
                 ) -> None:
        super().__init__()
        unknown = sorted({c.pooling.name for c in tables if c.pooling not in _POOLING})
        if unknown:
            raise ValueError(f"inference bags pool SUM or MEAN, got {unknown}")
        inits = dict(eval_initializers or {})
        self._configs = list(tables)
        self.features = [f for c in tables for f in c.feature_names]
        self.dims = [c.embedding_dim for c in tables for _ in c.feature_names]
        self.group_features: List[List[str]] = []
        groups, where = [], {}
        for pooling in dict.fromkeys(c.pooling for c in tables):
            mine = [c for c in tables if c.pooling == pooling]
            names = [f for c in mine for f in c.feature_names]
            col = 0
            for f, c in ((f, c) for c in mine for f in c.feature_names):
                where[f] = (len(groups), col)
                col += c.embedding_dim
            self.group_features.append(names)
            groups.append(InferenceEmbeddingTables(
                [_options(c, inits.get(c.name)) for c in mine], [c.name for c in mine],
                [t for t, c in enumerate(mine) for _ in c.feature_names], rows=rows,
                pooling_mode=_POOLING[pooling], dtype=dtype, device=device))
        self.groups = nn.ModuleList(groups)
        #: (group, first column) of each output feature, in the collection's order.
        self._columns = [where[f] for f in self.features]

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._configs

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        parts = [tables(*_batch(features, names))
                 for names, tables in zip(self.group_features, self.groups)]
        if len(parts) == 1:
            pooled = parts[0]
        else:
            pooled = torch.cat([parts[g][:, col:col + dim]
                                for (g, col), dim in zip(self._columns, self.dims)], dim=1)
        return KeyedTensor(keys=self.features, length_per_key=self.dims, values=pooled)


class InferenceEmbeddingCollection(nn.Module):
    """A frozen ``EmbeddingCollection``: ``forward(KeyedJaggedTensor) -> Dict[str,
    JaggedTensor]`` (one group of tables per dim).

    Args:
        tables: the collection's ``EmbeddingConfig``s.
        rows, eval_initializers, dtype, device: as ``InferenceEmbeddingBagCollection``'s.
    """

    def __init__(self, tables: List[EmbeddingConfig], rows: Rows,
                 eval_initializers: Optional[Mapping[str, DynamicEmbInitializerArgs]] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None
                 ) -> None:
        super().__init__()
        inits = dict(eval_initializers or {})
        self._configs = list(tables)
        self.features: List[List[str]] = []
        groups = []
        for dim in dict.fromkeys(c.embedding_dim for c in tables):
            mine = [c for c in tables if c.embedding_dim == dim]
            self.features.append([f for c in mine for f in c.feature_names])
            groups.append(InferenceEmbeddingTables(
                [_options(c, inits.get(c.name)) for c in mine], [c.name for c in mine],
                [t for t, c in enumerate(mine) for _ in c.feature_names], rows=rows,
                pooling_mode=DynamicEmbPoolingMode.NONE, dtype=dtype, device=device))
        self.groups = nn.ModuleList(groups)

    def embedding_configs(self) -> List[EmbeddingConfig]:
        return self._configs

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        out = {}
        for names, tables in zip(self.features, self.groups):
            indices, offsets, _ = _batch(features, names)
            rows = tables(indices, offsets)
            lengths = _lengths(features, names)
            parts = torch.split(rows, _sizes(lengths, rows.shape[0]))
            for f, part, n in zip(names, parts, lengths):
                out[f] = JaggedTensor(values=part, lengths=n)
        return out


def collection_twin(module: nn.Module, checkpoint: Optional[str], dtype: Optional[torch.dtype],
                    device: Optional[torch.device]) -> Optional[nn.Module]:
    """The inference twin of an unsharded EC/EBC with tables in ``checkpoint`` (other
    tables' rows from their weights, keys 0..num_embeddings-1), else None."""
    if isinstance(module, ShardedModule):
        raise ValueError(
            f"{type(module).__name__} is sharded: dump the model with DynamicEmbDump and "
            f"convert the unsharded model with to_inference(model, checkpoint=path)")
    bag = isinstance(module, EmbeddingBagCollection)
    if checkpoint is None or not (bag or isinstance(module, EmbeddingCollection)):
        return None
    configs = module.embedding_bag_configs() if bag else module.embedding_configs()
    weights = module.embedding_bags if bag else module.embeddings
    rows, manifest = read_rows(checkpoint, [c.name for c in configs
                                            if c.name in _saved_tables(checkpoint)])
    if not rows:
        return None
    inits = {name: saved_eval_initializer(manifest, name) for name in rows}
    for c in configs:
        if c.name not in rows:  # a static table: its weight, keyed 0..n-1
            weight = weights[c.name].weight.detach()
            rows[c.name] = (torch.arange(weight.shape[0], dtype=torch.int64), weight)
    cls = InferenceEmbeddingBagCollection if bag else InferenceEmbeddingCollection
    return cls(configs, rows, inits, dtype=dtype, device=device)


def _saved_tables(checkpoint: str) -> List[str]:
    _, manifest = read_rows(checkpoint, [])
    return list(manifest.tables)
