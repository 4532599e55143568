"""Every FBGEMM / upstream table keyword is honoured (checked against a reference) or
refused with its name; none is dropped.

References: ``torch.optim.AdamW`` / ``torch.optim.Adam`` on dense rows for the two
weight decay forms (every step touches every row, so lazy and dense updates agree);
the module built with our own keywords for FBGEMM's and upstream's spellings.
``test_against_dense.py`` and ``test_against_fbgemm.py`` cover the per-row math of
every optimizer with both weight decay forms and gradient clipping.
"""

import pytest
import torch

pytest.importorskip("fbgemm_gpu", reason="FBGEMM's enums are what this suite maps")
from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptimType
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    BatchedDynamicEmbeddingTablesV2,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
    DynamicEmbWeightDecayMode,
)
from dynamicemb.embedding.fused_params import module_kwargs

DIM, ROWS, STEPS = 4, 6, 5
KEYS = torch.tensor([3, -9, 10**15, 7, 2**62, 0])
ADAM = dict(learning_rate=0.05, eps=1e-6, beta1=0.8, beta2=0.95, weight_decay=0.1)


def _options(**kw) -> DynamicEmbTableOptions:
    return DynamicEmbTableOptions(dim=DIM, max_capacity=64, **kw)


def _train_module(module: BatchedDynamicEmbeddingTables, weights: torch.Tensor) -> torch.Tensor:
    """STEPS steps, each looking up every key once; returns the final rows in KEYS order."""
    module.import_keys_values("t0", KEYS, weights.clone())
    offsets = torch.arange(ROWS + 1)
    for step in range(STEPS):
        out = module(KEYS, offsets)
        (out * _target(step)).sum().backward()
    rows = module.export_keys_values("t0")
    order = {k: i for i, k in enumerate(rows.keys.tolist())}
    return rows.embeddings[[order[k] for k in KEYS.tolist()]]


def _train_dense(optimizer_cls, weights: torch.Tensor, **kw) -> torch.Tensor:
    w = torch.nn.Parameter(weights.clone())
    opt = optimizer_cls([w], **kw)
    for step in range(STEPS):
        opt.zero_grad()
        (w * _target(step)).sum().backward()
        opt.step()
    return w.detach()


def _target(step: int) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(100 + step))


def _weights() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))


def _adam_module(**kw) -> BatchedDynamicEmbeddingTables:
    return BatchedDynamicEmbeddingTables([_options()], pooling_mode="sum", **{
        "optimizer": DynamicEmbOptimType.ADAM, **ADAM, **kw})


def _adam_torch_kwargs() -> dict:
    return dict(lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                weight_decay=ADAM["weight_decay"], foreach=False)


@pytest.mark.parametrize("mode", [None, DynamicEmbWeightDecayMode.DECOUPLE,
                                  WeightDecayMode.DECOUPLE, 2, "decouple"],
                         ids=["default", "ours", "fbgemm", "int", "str"])
def test_adam_decoupled_weight_decay_is_adamw(mode):
    """Adam's weight decay by default (FBGEMM's and upstream's) and under every spelling
    of DECOUPLE: torch.optim.AdamW."""
    got = _train_module(_adam_module(weight_decay_mode=mode), _weights())
    want = _train_dense(torch.optim.AdamW, _weights(), **_adam_torch_kwargs())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    l2 = _train_dense(torch.optim.Adam, _weights(), **_adam_torch_kwargs())
    assert not torch.allclose(got, l2, rtol=1e-4, atol=1e-5)  # the two forms differ here


@pytest.mark.parametrize("mode", [DynamicEmbWeightDecayMode.L2, WeightDecayMode.L2, 1],
                         ids=["ours", "fbgemm", "int"])
def test_adam_l2_weight_decay_is_torch_adam(mode):
    got = _train_module(_adam_module(weight_decay_mode=mode), _weights())
    want = _train_dense(torch.optim.Adam, _weights(), **_adam_torch_kwargs())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("opt", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.EXACT_ADAGRAD,
                                 DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD])
def test_weight_decay_without_mode_is_refused_where_fbgemm_has_none(opt):
    """FBGEMM applies no weight decay to these optimizers: the same fused params are
    refused here rather than silently decayed (or silently not)."""
    with pytest.raises(ValueError, match="weight_decay_mode"):
        BatchedDynamicEmbeddingTables([_options()], optimizer=opt, weight_decay=0.01)
    with pytest.raises(ValueError, match="weight_decay_mode"):
        module_kwargs({"optimizer": FbgemmOptimType[opt.name], "weight_decay": 0.01})
    BatchedDynamicEmbeddingTables([_options()], optimizer=opt, weight_decay=0.0)


def test_weight_decay_modes_refused():
    with pytest.raises(ValueError, match="weight_decay_mode=NONE"):
        _adam_module(weight_decay_mode=WeightDecayMode.NONE)
    for mode in (WeightDecayMode.COUNTER, WeightDecayMode.COWCLIP, 3, "l1"):
        with pytest.raises(ValueError, match="weight_decay_mode"):
            _adam_module(weight_decay_mode=mode)


def test_initial_accumulator_value_is_the_new_rows_state():
    for opt, width in ((DynamicEmbOptimType.EXACT_ADAGRAD, DIM),
                       (DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, 1)):
        module = BatchedDynamicEmbeddingTables(
            [_options(initializer_args=DynamicEmbInitializerArgs(mode="constant", value=0.5))],
            **module_kwargs({"optimizer": FbgemmOptimType[opt.name],
                             "initial_accumulator_value": 0.25, "learning_rate": 0.1}))
        module(KEYS[:2], torch.tensor([0, 1, 2])).sum().backward()
        rows = module.export_keys_values("t0")
        g2 = torch.ones(width)  # d(sum)/d(row) = 1 for every element
        torch.testing.assert_close(rows.optimizer_states, (0.25 + g2).expand(2, width))
        torch.testing.assert_close(rows.embeddings,
                                   torch.full((2, DIM), 0.5 - 0.1 / (1.25 ** 0.5 + 1e-8)))


@pytest.mark.parametrize("dtype", [torch.float16, SparseType.FP16, SparseType.BF16])
def test_output_dtype(dtype):
    base = BatchedDynamicEmbeddingTables([_options()])
    other = BatchedDynamicEmbeddingTables([_options()], output_dtype=dtype)
    want = base(KEYS, torch.tensor([0, 3, 6]))
    got = other(KEYS, torch.tensor([0, 3, 6]))
    expected_dtype = dtype.as_dtype() if isinstance(dtype, SparseType) else dtype
    assert got.dtype == expected_dtype
    torch.testing.assert_close(got, want.to(expected_dtype))
    with pytest.raises(ValueError, match="output_dtype"):
        BatchedDynamicEmbeddingTables([_options()], output_dtype=SparseType.INT8)


# keyword -> a value dynamic tables cannot honour (each refused, naming the keyword)
REFUSED = {
    "max_norm": 1.0, "momentum": 0.5, "eta": 0.01, "counter_based_regularization": object(),
    "cowclip_regularization": object(), "global_weight_decay": object(),
    "cache_load_factor": 0.2, "cache_algorithm": 0, "cache_sets": 8,
    "cache_reserved_memory": 1.0, "weights_precision": SparseType.INT8,
    "cache_precision": SparseType.INT8, "embedding_table_index_type": torch.float32,
    "stochastic_rounding": 1,
    "uvm_host_mapped": True, "use_experimental_tbe": True, "multipass_prefetch_config": object(),
    "optimizer_state_dtypes": {"momentum1": SparseType.BF16}, "ensemble_mode": object(),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_keywords_are_refused_by_name(name):
    with pytest.raises(ValueError, match=name):
        BatchedDynamicEmbeddingTables([_options()], **{name: REFUSED[name]})
    with pytest.raises(ValueError, match=name):
        module_kwargs({name: REFUSED[name]})


def test_unknown_keyword_is_refused_by_name():
    with pytest.raises(TypeError, match="learning_rat"):
        BatchedDynamicEmbeddingTables([_options()], learning_rat=0.1)
    with pytest.raises(TypeError, match="foo"):
        module_kwargs({"foo": 1})
    with pytest.raises(ValueError, match="LAMB"):
        module_kwargs({"optimizer": FbgemmOptimType.LAMB})
    with pytest.raises(ValueError, match="max_gradient"):
        BatchedDynamicEmbeddingTables([_options()], gradient_clipping=True, max_gradient=0.0)


def test_arguments_after_feature_table_map_are_keyword_only():
    """Upstream's positional order differs (use_index_dedup, prefetch_pipeline, ...):
    a positional call is refused rather than misread."""
    with pytest.raises(TypeError):
        BatchedDynamicEmbeddingTables([_options()], None, None, True)


def _sgd_outputs(module: BatchedDynamicEmbeddingTables):
    offsets = torch.tensor([0, 2, 4, 6])
    outs = []
    for _ in range(3):
        out = module(KEYS, offsets)
        (out * torch.arange(1.0, out.numel() + 1).view(out.shape)).sum().backward()
        outs.append(out.detach())
    return outs, module.export_keys_values("t0")


def test_upstream_keywords_do_what_they_say():
    """BatchedDynamicEmbeddingTablesV2 (the same class) with upstream's and FBGEMM's
    keywords at values dynamic tables honour gives the module of our keywords."""
    assert BatchedDynamicEmbeddingTablesV2 is BatchedDynamicEmbeddingTables
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=3)
    upstream = BatchedDynamicEmbeddingTablesV2(
        [_options(initializer_args=init)], table_names=["t0"], feature_table_map=[0, 0, 0],
        use_index_dedup=True, prefetch_pipeline=True, pooling_mode=1, output_dtype=torch.float32,
        bounds_check_mode=BoundsCheckMode.WARNING, optimizer=FbgemmOptimType.SGD,
        stochastic_rounding=True, gradient_clipping=False, max_gradient=1.0, max_norm=0.0,
        learning_rate=0.3, eps=1e-8, initial_accumulator_value=0.0, momentum=0.9,
        weight_decay=0.0, weight_decay_mode=WeightDecayMode.NONE, eta=0.001, beta1=0.9,
        beta2=0.999, counter_based_regularization=None, cowclip_regularization=None,
        embedding_table_index_type=torch.int32, weights_precision=SparseType.FP32,
        enforce_hbm=True)
    ours = BatchedDynamicEmbeddingTables(
        [_options(initializer_args=init)], table_names=["t0"], feature_table_map=[0, 0, 0],
        pooling_mode=DynamicEmbPoolingMode.MEAN, optimizer=DynamicEmbOptimType.EXACT_SGD,
        learning_rate=0.3)
    assert upstream.optimizer_args("t0") == DynamicEmbOptimizerArgs(
        DynamicEmbOptimType.SGD, 0.3, weight_decay_mode="none")
    assert ours.optimizer_args("t0") == DynamicEmbOptimizerArgs(DynamicEmbOptimType.EXACT_SGD, 0.3)
    (got, got_rows), (want, want_rows) = _sgd_outputs(upstream), _sgd_outputs(ours)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(got_rows.embeddings, want_rows.embeddings, rtol=0, atol=0)
