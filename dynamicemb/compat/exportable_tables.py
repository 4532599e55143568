"""Upstream's serving entry points (``dynamicemb.exportable_tables``) over
``dynamicemb.inference`` (``docs/MIGRATING.md``)."""

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from dynamicemb.inference.checkpoint import read_rows, saved_eval_initializer
from dynamicemb.inference.module import InferenceEmbeddingTables
from dynamicemb.options import DynamicEmbPoolingMode, DynamicEmbTableOptions

__all__ = ["InferenceEmbeddingCollection", "apply_inference_embedding_collection",
           "create_inference_embedding_collection"]

#: Upstream's pooling codes.
_POOLING = {-1: DynamicEmbPoolingMode.NONE, 1: DynamicEmbPoolingMode.SUM,
            2: DynamicEmbPoolingMode.MEAN}


class InferenceEmbeddingCollection(nn.Module):
    """Frozen tables of one dim behind upstream's exportable call.

    Args:
        table_options: one ``DynamicEmbTableOptions`` per table (``dim`` shared).
        use_dynamic_hash: ids are raw keys (True) or row indices of the loaded weights
            (False, ``load_from_embedding_table``).
        pooling_mode: -1 none (``(N, D)``), 1 sum or 2 mean (``(F * B, D)``).
        table_names, feature_names, feature_table_map: as upstream (default one
            feature per table, tables ``table_0, ...``).
        output_dtype: the rows' and the output's dtype (float32, float16, bfloat16).
        device: where rows live (default CPU). ``key_type``: torch.int64 only.
    """

    def __init__(self, table_options: List[DynamicEmbTableOptions], use_dynamic_hash: bool,
                 pooling_mode: int, table_names: Optional[List[str]] = None,
                 feature_names: Optional[List[str]] = None,
                 feature_table_map: Optional[List[int]] = None,
                 output_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None,
                 key_type: torch.dtype = torch.int64) -> None:
        super().__init__()
        if pooling_mode not in _POOLING:
            raise ValueError(f"pooling_mode must be -1 (none), 1 (sum) or 2 (mean), got "
                             f"{pooling_mode}")
        if key_type != torch.int64:
            raise ValueError(f"key_type must be torch.int64 here, got {key_type}")
        if not table_options or len({o.dim for o in table_options}) != 1:
            raise ValueError("table_options must name tables of one shared dim")
        self.table_options = list(table_options)
        self.table_names_ = list(table_names) if table_names is not None else [
            f"table_{i}" for i in range(len(table_options))]
        self.feature_names_ = feature_names
        self.feature_table_map = list(feature_table_map) if feature_table_map is not None \
            else list(range(len(table_options)))
        if any(b < a for a, b in zip(self.feature_table_map, self.feature_table_map[1:])):
            raise ValueError("feature_table_map must be non-decreasing")
        self.use_dynamic_hash = use_dynamic_hash
        self.pooling_mode_ = pooling_mode
        self.output_dtype_ = output_dtype
        self.device = device
        empty = {n: (torch.empty(0, dtype=torch.int64), torch.empty(0, o.dim))
                 for n, o in zip(self.table_names_, self.table_options)}
        self._build(empty)

    def _build(self, rows) -> None:
        self.tables = InferenceEmbeddingTables(
            self.table_options, self.table_names_, self.feature_table_map, rows=rows,
            pooling_mode=_POOLING[self.pooling_mode_], dtype=self.output_dtype_,
            output_dtype=self.output_dtype_, device=self.device)

    def _current_rows(self) -> Dict:
        rows = {}
        for g in self.tables.groups:
            keys = g.index_keys_scores[:, 0]
            occupied = g.row_of_slot >= 0
            slots = occupied.nonzero().squeeze(1)
            tids, order = g.index_table_ids[slots].long(), g.row_of_slot[slots].long()
            for local, name in enumerate(g.names):
                mine = tids == local
                rows[name] = (keys[slots][mine], g.embeddings()[order[mine]].float())
        return rows

    def load_from_dynamicemb_file(self, save_dir: str,
                                  table_names: Optional[Sequence[str]] = None) -> None:
        """Replaces the named tables' rows (default all) by a ``DynamicEmbDump``
        checkpoint's; on ``CheckpointError`` nothing changes."""
        names = list(table_names) if table_names is not None else self.table_names_
        unknown = sorted(set(names) - set(self.table_names_))
        if unknown:
            raise ValueError(f"no table {unknown} here (tables: {self.table_names_})")
        saved, manifest = read_rows(save_dir, names)
        for name in names:
            options = self.table_options[self.table_names_.index(name)]
            options.eval_initializer_args = saved_eval_initializer(manifest, name)
        self._build({**self._current_rows(), **saved})

    def load_from_embedding_table(self, table_weights: torch.Tensor) -> None:
        """Rows of every table from one (rows, dim) tensor, ``init_capacity or
        max_capacity`` per table in order (the last takes the rest); ids index them."""
        caps = [o.init_capacity or o.max_capacity for o in self.table_options]
        dim = self.table_options[0].dim
        if table_weights.dim() != 2 or table_weights.shape[1] != dim:
            raise ValueError(f"table_weights must be (rows, {dim}), got "
                             f"{tuple(table_weights.shape)}")
        rows, start = {}, 0
        for i, name in enumerate(self.table_names_):
            end = table_weights.shape[0] if i == len(caps) - 1 else start + caps[i]
            part = table_weights[start:end]
            rows[name] = (torch.arange(part.shape[0], dtype=torch.int64), part)
            start = end
        self._build(rows)

    def forward(self, keys: torch.Tensor, offsets: torch.Tensor,
                pooling_offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Looks keys up (upstream's call form).

        Args:
            keys (Tensor): (N,) int64 ids, feature-major.
            offsets (Tensor): (F * B + 1,) boundaries of each feature's ids per sample.
            pooling_offsets (Tensor, optional): ``offsets``' shape (bags are ``offsets``').
            per_sample_weights (Tensor, optional): (N,) weights (sum pooling).

        Returns:
            (N, D) for pooling -1; (F * B, D) bags, feature-major, for 1 and 2.
        """
        if pooling_offsets is not None and pooling_offsets.shape != offsets.shape:
            raise ValueError("pooling_offsets must be the per-feature offsets (bags of "
                             "one feature and sample)")
        out = self.tables(keys, offsets, per_sample_weights)
        if self.pooling_mode_ == -1:
            return out
        features, dim = len(self.feature_table_map), self.table_options[0].dim
        return out.reshape(out.shape[0], features, dim).transpose(0, 1).reshape(-1, dim)


def create_inference_embedding_collection(embedding_configs, pooling_mode: int = -1,
                                          use_dynamic: bool = True,
                                          device: Optional[torch.device] = None
                                          ) -> InferenceEmbeddingCollection:
    """An empty ``InferenceEmbeddingCollection`` for TorchRec ``EmbeddingConfig``s."""
    options = [DynamicEmbTableOptions(dim=c.embedding_dim, max_capacity=c.num_embeddings)
               for c in embedding_configs]
    return InferenceEmbeddingCollection(
        options, use_dynamic, pooling_mode, [c.name for c in embedding_configs],
        [f for c in embedding_configs for f in c.feature_names],
        [t for t, c in enumerate(embedding_configs) for _ in c.feature_names], device=device)


def apply_inference_embedding_collection(model: nn.Module, dynamic_table_configs: Dict[str, bool],
                                         trained_emb_table_sizes: Dict[str, int]) -> nn.Module:
    """Swaps every TorchRec ``EmbeddingCollection`` of ``model`` in place for an empty
    ``InferenceEmbeddingCollection`` (sizes from ``trained_emb_table_sizes`` where given;
    one ``dynamic_table_configs`` flag per collection)."""
    from torchrec.modules.embedding_modules import EmbeddingCollection  # noqa: PLC0415

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, EmbeddingCollection)]
    swaps = []
    for name, module in found:
        configs = module.embedding_configs()
        flags = {dynamic_table_configs[c.name] for c in configs if c.name in dynamic_table_configs}
        if len(flags) != 1:
            raise ValueError(f"{name or 'model'}: dynamic_table_configs must give its tables "
                             f"{[c.name for c in configs]} one flag, got {sorted(flags)}")
        for c in configs:
            c.num_embeddings = trained_emb_table_sizes.get(c.name, c.num_embeddings)
        twin = create_inference_embedding_collection(configs, -1, flags.pop())
        twin.embedding_configs = configs
        swaps.append((name, twin))
    for name, twin in swaps:
        if name == "":
            return twin
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, twin)
    return model
