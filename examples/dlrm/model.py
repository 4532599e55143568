"""The DLRM of the training job: TorchRec's ``torchrec.models.dlrm`` over one
EmbeddingBagCollection with a table per categorical feature; the big tables are
made dynamic by planner constraints, the others stay TorchRec's static tables.
The data set the job's arguments name gives the tables' rows and the dense width
(``table_specs``, ``num_dense``; train.py and partition.py share them).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torchrec import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from data import CRITEO_CARDINALITIES, NUM_DENSE
from movielens import NUM_DENSE as MOVIELENS_DENSE
from movielens import load_movielens
from dynamicemb import (
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
)
from dynamicemb.planner import DynamicEmbParameterConstraints

__all__ = ["EMBEDDING_DTYPES", "PooledEmbeddingCollection", "TableSpec", "build_model",
           "constraints_for", "feature_names", "num_dense", "row_bytes", "table_specs", "to_kjt"]

#: ``--embedding-dtype`` -> the tables' TorchRec ``data_type``.
EMBEDDING_DTYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}


def row_bytes(dim: int, state_floats: int, data_type: DataType) -> int:
    """Bytes of a stored row: the embedding in ``data_type`` padded to 4 bytes, then the
    float32 optimizer state."""
    elem = 4 if data_type == DataType.FP32 else 2
    return -(-dim * elem // 4) * 4 + 4 * state_floats


@dataclass(frozen=True)
class TableSpec:
    """One categorical feature's table: its rows and whether it is dynamic.

    A static table has ``rows`` rows and sees ``id mod rows`` (the hashing trick a
    static table needs for raw ids); a dynamic table sees the raw id and holds at
    most ``rows`` of them (``max_capacity``), the least recently used evicted first.
    """

    feature: str
    rows: int
    dynamic: bool


def feature_names(count: int) -> List[str]:
    return [f"cat_{i}" for i in range(count)]


def table_specs(args) -> List[TableSpec]:
    """A table per categorical feature of the data set ``args`` name (train.py's or
    partition.py's arguments), dynamic from ``--dynamic-threshold`` rows.

    Rows: synthetic, Criteo's cardinalities x ``--scale``; tsv/parquet, Criteo's;
    movielens, the distinct values of each feature in the whole data set (``--data-dir``).
    """
    if args.data == "movielens":
        rows = list(load_movielens(args.data_dir).cardinalities)
    elif args.data == "synthetic":
        rows = [max(1, round(c * args.scale)) for c in CRITEO_CARDINALITIES]
    else:
        rows = list(CRITEO_CARDINALITIES)
    return [TableSpec(feature=f, rows=r, dynamic=r >= args.dynamic_threshold)
            for f, r in zip(feature_names(len(rows)), rows)]


def num_dense(args) -> int:
    """Dense features per sample of the data set ``args`` name."""
    return MOVIELENS_DENSE if args.data == "movielens" else NUM_DENSE


class PooledEmbeddingCollection(nn.Module):
    """An EmbeddingCollection whose per-id rows are summed per sample and feature, in
    the place of an EmbeddingBagCollection (what DLRM's sparse arch calls).

    Args:
        ec: the collection (sharded by DMP with the EC sharder).
    """

    def __init__(self, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ec = ec

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return [EmbeddingBagConfig(name=c.name, embedding_dim=c.embedding_dim,
                                   num_embeddings=c.num_embeddings, feature_names=c.feature_names)
                for c in self.ec.embedding_configs()]

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        sequences = self.ec(features)
        keys = list(sequences.keys())
        pooled = []
        for key in keys:
            jt = sequences[key]
            lengths = jt.lengths()
            owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device),
                                            lengths.long())
            values = jt.values()
            pooled.append(torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype,
                                      device=values.device).index_add_(0, owner, values))
        return KeyedTensor.from_tensor_list(keys, pooled)


def build_model(tables: Sequence[TableSpec], dim: int, dense_arch: Sequence[int],
                over_arch: Sequence[int], dense_features: int = NUM_DENSE,
                collection: str = "ebc", data_type: DataType = DataType.FP32) -> DLRMTrain:
    """The unsharded model (tables on ``meta``; DMP materializes them).

    Args:
        tables: one spec per categorical feature.
        dim: embedding dimension (also the dense arch's last width).
        dense_arch: widths of the bottom MLP; its last must equal ``dim``.
        over_arch: widths of the top MLP; its last must be 1.
        dense_features: dense features per sample (``num_dense``).
        collection: ``"ebc"`` (pooled tables) or ``"ec"`` (sequence tables summed per
            sample by ``PooledEmbeddingCollection``).
        data_type: the dynamic tables' (``EMBEDDING_DTYPES``); static tables stay FP32
            (FBGEMM's CPU kernels have no BF16 rows).
    """
    if dense_arch[-1] != dim:
        raise ValueError(f"the dense arch must end at the embedding dim {dim}, got {list(dense_arch)}")
    if over_arch[-1] != 1:
        raise ValueError(f"the over arch must end at 1, got {list(over_arch)}")
    meta = torch.device("meta")
    if collection == "ec":
        ebc = PooledEmbeddingCollection(EmbeddingCollection(tables=[
            EmbeddingConfig(name=f"t_{t.feature}", embedding_dim=dim, num_embeddings=t.rows,
                            feature_names=[t.feature], data_type=_dtype(t, data_type))
            for t in tables], device=meta))
    else:
        ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{t.feature}", embedding_dim=dim, num_embeddings=t.rows,
                               feature_names=[t.feature], data_type=_dtype(t, data_type))
            for t in tables], device=meta)
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=dense_features,
                          dense_arch_layer_sizes=list(dense_arch),
                          over_arch_layer_sizes=list(over_arch)))


def _dtype(table: TableSpec, data_type: DataType) -> DataType:
    return data_type if table.dynamic else DataType.FP32


def constraints_for(tables: Sequence[TableSpec], dim: int, row_bytes: int,
                    cache_fraction: float, score_strategy: DynamicEmbScoreStrategy,
                    admission_threshold: int, placement: Optional[str] = None,
                    replicas: float = 0, staleness: int = 0,
                    stochastic: bool = True) -> Dict[str, DynamicEmbParameterConstraints]:
    """Planner constraints making the dynamic tables dynamic (row-wise by key hash).

    Args:
        placement: a placement file (``examples/dlrm/partition.py``) for every dynamic
            table (None: ids on their key-hash owner).
        row_bytes: bytes of a stored row (``row_bytes``: sizes the cache budget).
        cache_fraction: the device cache of a dynamic table holds this fraction of its
            rows (1.0 or more: every row in device memory, no cache).
        admission_threshold: occurrences before a new id gets a row (1: admit all).
        replicas: hot-row replicas of every dynamic table (``DynamicEmbTableOptions``).
        staleness: their ``replica_staleness`` (0: synchronous).
        stochastic: 16-bit rows' ``stochastic_rounding`` (else to nearest).
    """
    out = {}
    for t in tables:
        if not t.dynamic:
            continue
        caching = cache_fraction < 1.0
        options = DynamicEmbTableOptions(
            dim=dim, max_capacity=t.rows, score_strategy=score_strategy, caching=caching,
            local_hbm_for_values=(max(16, int(t.rows * cache_fraction)) * row_bytes
                                  if caching else None),
            admit_strategy=(FrequencyAdmissionStrategy(threshold=admission_threshold)
                            if admission_threshold > 1 else None), placement=placement,
            replicas=replicas, replica_staleness=staleness if replicas else 0,
            stochastic_rounding=stochastic)
        out[f"t_{t.feature}"] = DynamicEmbParameterConstraints(
            use_dynamicemb=True, sharding_types=["row_wise"], dynamicemb_options=options)
    return out


def to_kjt(sparse: torch.Tensor, tables: Sequence[TableSpec]) -> KeyedJaggedTensor:
    """One id per sample and feature as a KJT; static tables get ``id mod rows``.

    Args:
        sparse (Tensor): (B, F) int64 raw ids.
    """
    columns = []
    for f, t in enumerate(tables):
        ids = sparse[:, f]
        columns.append(ids if t.dynamic else torch.remainder(ids, t.rows))
    values = torch.stack(columns).reshape(-1)  # feature-major, as a KJT keeps them
    lengths = torch.ones(values.numel(), dtype=torch.int32)
    return KeyedJaggedTensor(keys=[t.feature for t in tables], values=values, lengths=lengths)
