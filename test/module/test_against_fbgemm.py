"""``BatchedDynamicEmbeddingTables`` against FBGEMM's CPU table-batched embedding.

FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (host memory, CPU compute) is the
module that TorchRec uses for dense tables; ours must be a drop-in for it. FBGEMM
indexes rows ``0..n-1`` per table, so each test gives every table a pool of raw ids
(huge and negative ones included), maps them to dense rows for FBGEMM, copies the same
initial weights (and optimizer states) into both, trains ten steps with the same
gradients and compares outputs, rows and optimizer states.

What FBGEMM's CPU path defines, as observed with fbgemm-gpu-cpu 1.8.0:

- EXACT_SGD: ``w -= lr * g``; EXACT_ADAGRAD: ``s += g^2; w -= lr * g / (sqrt(s) + eps)``
  per element, state ``(rows, dim)``; EXACT_ROWWISE_ADAGRAD: ``s += mean(g^2)`` over the
  row, ``w -= lr * g / (sqrt(s) + eps)``, state ``(rows,)``. Duplicate ids of a batch
  have their gradients summed first. Momentum starts at 0 (we copy ours in instead).
- ``weight_decay`` has no effect on the CPU path for any of the three optimizers and
  any ``weight_decay_mode`` (NONE, L2, DECOUPLE): FBGEMM documents that EXACT_SGD and
  EXACT_ADAGRAD do not support weight decay, and its CPU rowwise Adagrad ignores it too.
  So weight decay is compared only with the dense reference; the test below probes
  FBGEMM first and compares with ``WeightDecayMode.L2`` only where FBGEMM applies it.
- ADAM is refused on CPU ("not supported in CPU mode"): compared only with the dense
  reference (``test_against_dense.py``).
- The CPU backward requires the features of one table to be adjacent in
  ``feature_table_map``: ``[0, 1, 0]`` fails (rowwise Adagrad raises "num of rows
  processed by adagrad ... does not match c_block size") so the shared-table layout here
  is ``[0, 0, 1]``; ``test_against_dense.py`` covers non-adjacent sharing.
"""

# CPU only: the reference is FBGEMM's CPU kernels.

from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from dynamicemb_testing.module_reference import export_dict, id_pool, random_batch

fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode  # noqa: E402

SUM, MEAN, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE
FBGEMM_POOLING = {SUM: PoolingMode.SUM, MEAN: PoolingMode.MEAN, NONE: PoolingMode.NONE}
OPTIMIZERS = [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
LR = {EmbOptimType.EXACT_SGD: 0.1, EmbOptimType.EXACT_ADAGRAD: 0.05,
      EmbOptimType.EXACT_ROWWISE_ADAGRAD: 0.05}
STEPS = 10
TOL = dict(rtol=1e-6, atol=1e-6)


@dataclass
class Pair:
    """Our module, FBGEMM's, and the raw id of each FBGEMM row per table."""

    ours: BatchedDynamicEmbeddingTables
    fbgemm: torch.nn.Module
    pools: List[List[int]]
    row_of: List[Dict[int, int]]
    feature_table_map: List[int]

    def fbgemm_indices(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Raw ids -> FBGEMM's per-table rows, feature by feature."""
        batch = (offsets.numel() - 1) // len(self.feature_table_map)
        out = torch.empty_like(indices, dtype=torch.int64)
        for f, t in enumerate(self.feature_table_map):
            lo, hi = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
            out[lo:hi] = torch.tensor([self.row_of[t][k] for k in indices[lo:hi].tolist()],
                                      dtype=torch.int64)
        return out


def make_pair(opt: EmbOptimType, pooling, dims: List[int], ftm: List[int], weight_decay=0.0,
              seed=0, pool_size=10, **both) -> Pair:
    """Both modules with identical initial rows (every pool id) and optimizer states;
    ``both``: further keywords given to both (FBGEMM's names)."""
    gen = torch.Generator().manual_seed(seed)
    fbgemm = fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen(
        [(pool_size, d, EmbeddingLocation.HOST, fbgemm_training.ComputeDevice.CPU) for d in dims],
        feature_table_map=ftm, optimizer=opt, learning_rate=LR[opt], eps=1e-8,
        weight_decay=weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if weight_decay else WeightDecayMode.NONE,
        pooling_mode=FBGEMM_POOLING[pooling], **both)
    ours = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=d, max_capacity=256) for d in dims], feature_table_map=ftm,
        pooling_mode=pooling, optimizer=opt, learning_rate=LR[opt], eps=1e-8,
        weight_decay=weight_decay,
        weight_decay_mode=WeightDecayMode.L2 if weight_decay else WeightDecayMode.NONE, **both)
    pools = [id_pool(pool_size, seed + 13 * t) for t in range(len(dims))]
    fb_states = fbgemm.split_optimizer_states()
    for t, (name, pool) in enumerate(zip(ours.table_names, pools)):
        rows = torch.rand(pool_size, dims[t], generator=gen) - 0.5
        states = None
        with torch.no_grad():
            fbgemm.split_embedding_weights()[t].copy_(rows)
            if fb_states:
                momentum = fb_states[t][0]
                momentum.copy_(torch.rand(momentum.shape, generator=gen))
                states = momentum.reshape(pool_size, -1).clone()
        ours.import_keys_values(name, torch.tensor(pool), rows, states)
    return Pair(ours, fbgemm, pools, [{k: i for i, k in enumerate(p)} for p in pools], ftm)


def fbgemm_table(pair: Pair, t: int):
    """(rows, optimizer state (rows, state_dim) or None) of FBGEMM table t, in pool order."""
    weights = pair.fbgemm.split_embedding_weights()[t].detach()
    states = pair.fbgemm.split_optimizer_states()
    state = states[t][0].detach().reshape(weights.shape[0], -1) if states else None
    return weights, state


def assert_same_tables(pair: Pair) -> None:
    for t, name in enumerate(pair.ours.table_names):
        ours = export_dict(pair.ours, name)
        assert sorted(ours) == sorted(pair.pools[t]), "our table gained or lost rows"
        weights, state = fbgemm_table(pair, t)
        torch.testing.assert_close(torch.stack([ours[k][0] for k in pair.pools[t]]), weights,
                                   **TOL, msg=lambda m: f"table {t} rows: {m}")
        if state is not None:
            torch.testing.assert_close(torch.stack([ours[k][1] for k in pair.pools[t]]), state,
                                       **TOL, msg=lambda m: f"table {t} optimizer state: {m}")


def train_both(pair: Pair, seed: int, weighted: bool, batch: int = 6) -> None:
    gen = torch.Generator().manual_seed(seed)
    feature_pools = [pair.pools[t] for t in pair.feature_table_map]
    for step in range(STEPS):
        indices, offsets, weights = random_batch(feature_pools, batch, gen, weighted=weighted)
        fb_weights = None
        if weights is not None:  # both get their own leaf: their gradients are compared
            weights, fb_weights = weights.requires_grad_(), weights.detach().clone().requires_grad_()
        out = pair.ours(indices, offsets, weights)
        fb_out = pair.fbgemm(pair.fbgemm_indices(indices, offsets), offsets,
                             per_sample_weights=fb_weights)
        torch.testing.assert_close(out.detach(), fb_out.detach(), **TOL,
                                   msg=lambda m: f"step {step} output: {m}")
        grad = torch.randn(out.shape, generator=gen)
        (out * grad).sum().backward()
        (fb_out * grad).sum().backward()
        if weights is not None:
            torch.testing.assert_close(weights.grad, fb_weights.grad, **TOL,
                                       msg=lambda m: f"step {step} weights' gradient: {m}")
    assert_same_tables(pair)


def layout(kind: str, pooling) -> tuple:
    if kind == "single":
        return [8], [0]
    return ([4, 4] if pooling == NONE else [4, 8]), [0, 0, 1]


GRID = [
    (opt, pooling, kind, weighted)
    for opt in OPTIMIZERS
    for pooling in (SUM, MEAN, NONE)
    for kind in ("single", "shared")
    for weighted in ((False, True) if pooling == SUM else (False,))
]


@pytest.mark.parametrize("opt,pooling,kind,weighted", GRID,
                         ids=[f"{o.name}-{p.name}-{k}-{'w' if w else 'nw'}" for o, p, k, w in GRID])
def test_training_matches_fbgemm(opt, pooling, kind, weighted):
    dims, ftm = layout(kind, pooling)
    pair = make_pair(opt, pooling, dims, ftm, seed=3)
    train_both(pair, seed=4, weighted=weighted)


def fbgemm_cpu_applies_weight_decay(opt: EmbOptimType) -> bool:
    """Whether FBGEMM's CPU update with ``WeightDecayMode.L2`` differs from no decay."""
    rows = []
    for wd in (0.0, 0.5):
        fbgemm = fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen(
            [(2, 4, EmbeddingLocation.HOST, fbgemm_training.ComputeDevice.CPU)], optimizer=opt,
            learning_rate=0.1, weight_decay=wd, weight_decay_mode=WeightDecayMode.L2)
        with torch.no_grad():
            fbgemm.split_embedding_weights()[0].fill_(1.0)
        fbgemm(torch.tensor([0]), torch.tensor([0, 1])).sum().backward()
        rows.append(fbgemm.split_embedding_weights()[0].detach().clone())
    return not torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_weight_decay_matches_fbgemm_l2(opt):
    """Our weight decay is FBGEMM's ``WeightDecayMode.L2`` (where FBGEMM's CPU path has it)."""
    if not fbgemm_cpu_applies_weight_decay(opt):
        pytest.skip(f"FBGEMM's CPU {opt.name} ignores weight_decay (see the module docstring)")
    pair = make_pair(opt, SUM, [4, 8], [0, 0, 1], weight_decay=0.05, seed=5)
    train_both(pair, seed=6, weighted=True)


CLIP_GRID = [(o, p) for o in OPTIMIZERS for p in (SUM, NONE)]


@pytest.mark.parametrize("opt,pooling", CLIP_GRID, ids=[f"{o.name}-{p.name}" for o, p in CLIP_GRID])
def test_gradient_clipping_matches_fbgemm(opt, pooling):
    """``gradient_clipping``/``max_gradient`` as FBGEMM's: the output's gradient is clamped
    elementwise before the update and the per-sample weights' gradient (half of this
    test's gradients exceed the bound)."""
    pair = make_pair(opt, pooling, *layout("shared", pooling), seed=7, gradient_clipping=True,
                     max_gradient=0.5, stochastic_rounding=False)
    train_both(pair, seed=8, weighted=pooling == SUM)


def test_optimizer_enum_of_fbgemm_is_accepted():
    """FBGEMM's ``EmbOptimType`` members name our optimizers."""
    for opt in OPTIMIZERS:
        module = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=2, max_capacity=16)],
                                               optimizer=opt)
        assert module.optimizer.param_groups[0]["optimizer"] == DynamicEmbOptimType[opt.name].name
    with pytest.raises(ValueError):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=2, max_capacity=16)],
                                      optimizer=EmbOptimType.LAMB)
