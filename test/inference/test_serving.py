"""Serving: inference twins equal the trained modules' eval, survive export, compile
and checkpoints, and refuse bad input loudly."""

import os
import subprocess
import sys

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, CheckpointError, DynamicEmbDump,
                        DynamicEmbInitializerArgs, DynamicEmbPoolingMode, DynamicEmbTableOptions)
from dynamicemb.inference import InferenceEmbeddingTables, to_inference
from dynamicemb_testing.scripts import script_env

POOLINGS = [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE]
#: Largest |twin - trained| relative to the largest |output| per 16-bit row dtype: the
#: rows' one rounding (2^-11 float16, 2^-8 bfloat16), pooling runs in float32.
TOLERANCE = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
FEATURES = [0, 1, 1, 2]  # table of each feature; table 1 has two


def _batch(seed: int, batch: int = 6, id_range: int = 120):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    return torch.randint(0, id_range, (n,), generator=g), offsets, torch.rand(n, generator=g)


def _trained(pooling=DynamicEmbPoolingMode.SUM, dtype=torch.float32,
             dims=None) -> BatchedDynamicEmbeddingTables:
    """Three tables of rows of ``dtype`` (two dims unless NONE), one with a random eval
    initializer, trained a few steps on ids 0..79 (eval batches also ask for unseen ids)."""
    if dims is None:
        dims = [4, 4, 4] if pooling == DynamicEmbPoolingMode.NONE else [4, 8, 4]
    options = [DynamicEmbTableOptions(dim=d, max_capacity=512, embedding_dtype=dtype)
               for d in dims]
    options[1].eval_initializer_args = DynamicEmbInitializerArgs(mode="normal", seed=7)
    module = BatchedDynamicEmbeddingTables(options, ["a", "b", "c"], FEATURES,
                                           pooling_mode=pooling, optimizer="adam",
                                           learning_rate=0.05)
    for step in range(3):
        indices, offsets, _ = _batch(step, id_range=80)
        out = module(indices, offsets)
        out.square().sum().backward()
    return module.eval()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_twin_equals_eval_exactly_in_float32(pooling):
    module = _trained(pooling)
    twin = InferenceEmbeddingTables.from_module(module)
    for seed in (10, 11):
        indices, offsets, weights = _batch(seed)
        assert torch.equal(twin(indices, offsets), module(indices, offsets))
        if pooling == DynamicEmbPoolingMode.SUM:
            assert torch.equal(twin(indices, offsets, weights), module(indices, offsets, weights))
    assert twin.num_rows() == sum(module.table_size(n) for n in module.table_names)


SIXTEEN_BIT = sorted(TOLERANCE, key=str)


def _dims(pooling, odd: bool):
    """Dims of ``_trained``'s tables; odd ones pad a 16-bit row to whole words."""
    if pooling == DynamicEmbPoolingMode.NONE:
        return [5, 5, 5] if odd else [4, 4, 4]
    return [5, 8, 3] if odd else [4, 8, 4]


@pytest.mark.parametrize("odd", [False, True], ids=["even-dims", "odd-dims"])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_twin_of_16bit_tables_equals_eval_exactly(dtype, pooling, odd):
    """A twin of 16-bit tables holds their rows as they are (no rounding, half the bytes,
    an odd dim padded to a word) and gives their eval outputs bit for bit, unseen ids'
    initializer rows included (rounded as the table's)."""
    dims = _dims(pooling, odd)
    module = _trained(pooling, dtype, dims)
    twin = InferenceEmbeddingTables.from_module(module)  # rows of the tables' dtype
    for g in twin.groups:
        assert g.rows.dtype == dtype and g.rows.shape[1] == g.dim + g.dim % 2
        for t, name in enumerate(g.names):
            exported = module.export_keys_values(name)
            mine = g.index_table_ids[g.row_of_slot[:-1] >= 0] == t
            assert int(mine.sum()) == exported.keys.numel()
    for seed in (10, 11):
        indices, offsets, weights = _batch(seed)
        assert torch.equal(twin(indices, offsets), module(indices, offsets))
        if pooling == DynamicEmbPoolingMode.SUM:
            assert torch.equal(twin(indices, offsets, weights), module(indices, offsets, weights))
    assert twin.memory_bytes()["rows"] == sum(
        module.table_size(n) * 2 * (d + d % 2) for n, d in zip("abc", dims))


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_16bit_rows_are_frozen_rounded_to_nearest(dtype):
    """Float32 rows frozen into 16 bits are rounded to nearest once, as the tables'
    imports round them."""
    module = _trained(dims=[5, 8, 3])
    twin = InferenceEmbeddingTables.from_module(module, dtype=dtype)
    for g in twin.groups:
        keys = g.index_keys_scores[:, 0]
        held = (g.row_of_slot[:-1] >= 0).nonzero().squeeze(1)
        for t, name in enumerate(g.names):
            at = held[g.index_table_ids[held] == t]
            exported = module.export_keys_values(name)
            order = torch.argsort(exported.keys)
            want = exported.embeddings[order][torch.searchsorted(exported.keys[order],
                                                                 keys[at])]
            assert torch.equal(g.embeddings()[g.row_of_slot[at]], want.to(dtype))


def test_export_of_16bit_rows_of_an_odd_dim():
    """The op's fake gives (N, dim), not the padded rows' width."""
    module = _trained(DynamicEmbPoolingMode.NONE, torch.bfloat16, [5, 5, 5])
    twin = InferenceEmbeddingTables.from_module(module)
    batch = _batch(18)[:2]
    program = torch.export.export(twin, batch)
    (node,) = [n for n in program.graph.nodes if "frozen_lookup" in str(n.target)]
    assert tuple(node.meta["val"].shape) == (batch[0].numel(), 5)
    assert torch.equal(program.module()(*batch), module(*batch))
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*batch), module(*batch))


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_16bit_rows_within_their_rounding(dtype):
    module = _trained()
    twin = InferenceEmbeddingTables.from_module(module, dtype=dtype)
    indices, offsets, weights = _batch(12)
    want, got = module(indices, offsets, weights), twin(indices, offsets, weights)
    assert (got - want).abs().max() <= TOLERANCE[dtype] * want.abs().max() * 4
    assert twin.memory_bytes()["rows"] * 2 == InferenceEmbeddingTables.from_module(
        module).memory_bytes()["rows"]


def test_bad_input_is_refused():
    module = _trained()
    with pytest.raises(ValueError, match="float64"):
        InferenceEmbeddingTables.from_module(module, dtype=torch.float64)
    twin = InferenceEmbeddingTables.from_module(module)
    indices, offsets, _ = _batch(13)
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        twin(indices.float(), offsets)
    with pytest.raises(ValueError, match="non-decreasing"):
        twin(indices, offsets.flip(0))
    with pytest.raises(ValueError, match="SUM pooling"):
        InferenceEmbeddingTables.from_module(_trained(DynamicEmbPoolingMode.MEAN))(
            indices, offsets, torch.ones(indices.numel()))
    rows = {"a": (torch.tensor([1, 2, 1]), torch.zeros(3, 4))}
    with pytest.raises(ValueError, match="key 1 more than once"):
        InferenceEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=8)], ["a"],
                                 rows=rows)
    with pytest.raises(ValueError, match="no rows given for table 'b'"):
        InferenceEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=8)], ["b"],
                                 rows=rows)


def test_tables_of_several_row_dtypes_need_one_for_the_twin():
    options = [DynamicEmbTableOptions(dim=4, max_capacity=8),
               DynamicEmbTableOptions(dim=4, max_capacity=8, embedding_dtype=torch.bfloat16)]
    rows = {n: (torch.tensor([1, 2]), torch.ones(2, 4)) for n in "ab"}
    with pytest.raises(ValueError, match=r"tables \['a', 'b'\] store rows of "
                       r"\['torch.bfloat16', 'torch.float32'\]: give the twin one dtype"):
        InferenceEmbeddingTables(options, ["a", "b"], rows=rows)
    twin = InferenceEmbeddingTables(options, ["a", "b"], rows=rows, dtype=torch.bfloat16)
    assert [g.rows.dtype for g in twin.groups] == [torch.bfloat16]


class _Model(torch.nn.Module):
    def __init__(self, tables):
        super().__init__()
        self.tables = tables
        self.head = torch.nn.Linear(24, 1)

    def forward(self, indices, offsets, weights):
        return self.head(self.tables(indices, offsets, weights))


def test_checkpoint_twin_and_damage(tmp_path):
    module = _trained()
    path = str(tmp_path / "ck")
    DynamicEmbDump(path, module)
    model = _Model(module)
    indices, offsets, weights = _batch(14)
    want = model(indices, offsets, weights)
    version = os.path.realpath(os.path.join(path, open(os.path.join(path, "CURRENT")).read().strip()))
    victim = next(os.path.join(version, f) for f in sorted(os.listdir(version)) if "embeddings" in f)
    data = bytearray(open(victim, "rb").read())
    data[0] ^= 1
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        to_inference(model, checkpoint=path)
    assert model.tables is module  # nothing swapped
    data[0] ^= 1
    open(victim, "wb").write(bytes(data))
    twin = to_inference(model, checkpoint=path)
    assert isinstance(twin.tables, InferenceEmbeddingTables)
    assert torch.equal(twin(indices, offsets, weights), want)


def test_missing_table_is_named(tmp_path):
    path = str(tmp_path / "ck")
    DynamicEmbDump(path, _trained())
    other = BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=4, max_capacity=8)], ["z"])
    with pytest.raises(CheckpointError, match=r"no table \['z'\]"):
        to_inference(_Model(other), checkpoint=path)


_LOAD_SCRIPT = """
import sys, torch
import dynamicemb  # registers torch.ops.dynamicemb.frozen_lookup
program = torch.export.load(sys.argv[1])
inputs = torch.load(sys.argv[2], weights_only=True)
for batch, want in zip(inputs["batches"], inputs["outputs"]):
    assert torch.equal(program.module()(*batch), want), "outputs differ"
print("ok")
"""


def test_export_save_load_in_a_fresh_process_and_compile(tmp_path):
    model = _Model(InferenceEmbeddingTables.from_module(_trained())).eval()
    batches = [_batch(15), _batch(16, batch=9)]
    dim = torch.export.Dim
    program = torch.export.export(model, batches[0], dynamic_shapes={
        "indices": {0: dim("n")}, "offsets": {0: dim("bags", min=9)},
        "weights": {0: dim("n")}})
    assert "dynamicemb.frozen_lookup" in str(program.graph)
    torch.export.save(program, str(tmp_path / "model.pt2"))
    outputs = [model(*b) for b in batches]
    torch.save({"batches": batches, "outputs": outputs}, str(tmp_path / "io.pt"))
    done = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(tmp_path / "model.pt2"),
                           str(tmp_path / "io.pt")], capture_output=True, text=True,
                          timeout=120, env=script_env())
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # no graph break
    assert torch.equal(compiled(*batches[0]), outputs[0])


def test_training_module_under_compile_equals_eager():
    """The training step breaks the graph at the table (its forward drives hash-table
    kernels and a fused backward); compiled and eager runs still train alike."""
    eager, compiled_tables = _trained().train(), _trained().train()
    compiled = torch.compile(_Model(compiled_tables), backend="eager")
    reference = _Model(eager)
    compiled.head.load_state_dict(reference.head.state_dict())
    for step in range(2):
        indices, offsets, weights = _batch(20 + step)
        a, b = reference(indices, offsets, weights), compiled(indices, offsets, weights)
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
    keys = eager.export_keys_values("b")
    assert torch.equal(keys.embeddings, compiled_tables.export_keys_values("b").embeddings)


def test_dmp_two_ranks_served_on_one(tmp_path):
    """EC and EBC tables trained under DMP on 2 ranks (dynamic row-wise and table-wise,
    a static table in each, SUM and MEAN bags), dumped, served by the unsharded
    model's twin in this process: every rank's eval outputs (EC exactly)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dynamicemb.inference.collections import (InferenceEmbeddingBagCollection,
                                                  InferenceEmbeddingCollection)
    from dynamicemb_testing import serving_workers
    from dynamicemb_testing import shard_workers as sw
    from dynamicemb_testing.dist_utils import run_distributed

    path, record = str(tmp_path / "ck"), str(tmp_path / "record.pt")
    run_distributed(serving_workers.train_dump_and_eval, 2, path, record)
    saved = torch.load(record, weights_only=True)
    model = sw.TwinModel().to_empty(device="cpu")
    for name, weight in saved["static"].items():
        table = model.ec.embeddings if name in sw.EC_TABLES else model.ebc.embedding_bags
        table[name].weight.data.copy_(weight)
    model = to_inference(model, checkpoint=path)
    assert isinstance(model.ec, InferenceEmbeddingCollection)
    assert isinstance(model.ebc, InferenceEmbeddingBagCollection)
    for batch in saved["evals"]:
        ec_out, ebc_out = model(KeyedJaggedTensor(**batch["ec"]), KeyedJaggedTensor(**batch["ebc"]))
        # A sharded EBC orders its keys by sharding, and pools row-wise tables in
        # another float order (partial sums per rank, or the sender's embedding_bag
        # after dedup): equal to rounding. Exactness against the unsharded pooling is
        # test_twin_equals_eval_exactly_in_float32.
        got = ebc_out.to_dict()
        for f, want in batch["ebc_out"].items():
            torch.testing.assert_close(got[f], want, rtol=1e-6, atol=1e-6, msg=f)
        for f, want in batch["ec_out"].items():
            assert torch.equal(ec_out[f].values(), want), f


@pytest.mark.parametrize("pooling", [-1, 1])
def test_upstream_exportable_tables(tmp_path, pooling):
    from dynamicemb.exportable_tables import InferenceEmbeddingCollection

    mode = DynamicEmbPoolingMode.NONE if pooling == -1 else DynamicEmbPoolingMode.SUM
    module = _trained(DynamicEmbPoolingMode.NONE)
    module.pooling_mode = mode  # same rows, pooled or not
    path = str(tmp_path / "ck")
    DynamicEmbDump(path, module)
    upstream = InferenceEmbeddingCollection(
        [DynamicEmbTableOptions(dim=4, max_capacity=512) for _ in range(3)], True, pooling,
        table_names=["a", "b", "c"], feature_table_map=FEATURES)
    upstream.load_from_dynamicemb_file(path)
    indices, offsets, _ = _batch(30)
    want = module(indices, offsets)
    if pooling == 1:  # (B, F * D) -> upstream's (F * B, D), feature-major
        want = want.reshape(want.shape[0], len(FEATURES), 4).transpose(0, 1).reshape(-1, 4)
    assert torch.equal(upstream(indices, offsets, offsets), want)
    if pooling == -1:  # rows by index: tables of capacity 4, 4 and the remaining 2
        by_index = InferenceEmbeddingCollection(
            [DynamicEmbTableOptions(dim=4, max_capacity=4) for _ in range(3)], False, -1,
            feature_table_map=FEATURES)
        weights = torch.randn(10, 4)
        by_index.load_from_embedding_table(weights)
        ids, offs = torch.tensor([1, 3, 0, 1]), torch.tensor([0, 1, 2, 3, 4])
        assert torch.equal(by_index(ids, offs), weights[[1, 4 + 3, 4 + 0, 8 + 1]])


def test_op_has_cpu_cuda_and_fake_kernels():
    """Registered on import, for CPU and CUDA (the CUDA kernel runs the CUDA backend's
    kernels; it needs a GPU to run) and with a fake kernel for tracing."""
    import dynamicemb  # noqa: F401

    for key in ("CPU", "CUDA", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("dynamicemb::frozen_lookup", key), key
