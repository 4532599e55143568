"""Rank body of the ``ConstructTwinModule`` test (spawned; importable, no pytest here)."""

import gc
import random

import torch
import torchrec
from torchrec.modules.embedding_configs import PoolingType

from dynamicemb import BatchedDynamicEmbeddingTables
from dynamicemb.construct_twin_module import ConstructTwinModule
from dynamicemb.dump_load import get_dynamic_emb_module


def _features(num_embeddings, batch: int, rng: random.Random) -> torchrec.KeyedJaggedTensor:
    values, lengths = [], []
    for table, rows in enumerate(num_embeddings):
        for _ in range(batch):
            bag = rng.sample(range(rows), rng.randint(0, 3))
            values += bag
            lengths.append(len(bag))
    return torchrec.KeyedJaggedTensor(keys=[f"f_{t}" for t in range(len(num_embeddings))],
                                      values=torch.tensor(values, dtype=torch.int64),
                                      lengths=torch.tensor(lengths, dtype=torch.int64))


def _flat(out, pooled: bool) -> torch.Tensor:
    return out.values() if pooled else torch.cat([out[k].values() for k in sorted(out.keys())])


def twins_train_alike(rank: int, world_size: int, pooled: bool, optimizer: str) -> None:
    """Both models of a twin give equal outputs over 4 training steps."""
    torch.manual_seed(rank)  # init_fn's rows differ per rank: rank 0's are broadcast
    num_embeddings = [200, 300]

    def construct() -> ConstructTwinModule:
        return ConstructTwinModule(
            2, [8, 8], num_embeddings, PoolingType.SUM if pooled else None, pooled, [3, 3],
            optimizer_kwargs={"optimizer": optimizer, "learning_rate": 0.05, "eps": 1e-8}
            if optimizer != "sgd" else {"optimizer": "sgd", "learning_rate": 0.05},
            use_index_dedup=True, rank=rank, world_size=world_size)

    twin = construct()
    assert twin.dynamicemb_model is None
    twin.init_twin_embedding_model()
    dynamic, native = twin.dynamicemb_model, twin.torchrec_model
    assert get_dynamic_emb_module(dynamic) and not get_dynamic_emb_module(native)
    rng = random.Random(100 + rank)
    for step in range(4):
        features = _features(num_embeddings, 16, rng)
        outs = [_flat(model(features), pooled) for model in (dynamic, native)]
        for out in outs:
            out.sum().backward()
        torch.testing.assert_close(outs[0], outs[1], msg=lambda m: f"step {step}: {m}")
    # a new build frees the dropped one (TorchRec's collections are reference cycles)
    gc.disable()
    try:
        del dynamic, native, twin, outs  # outputs keep their autograd nodes
        again = construct()
        again.init_twin_embedding_model()
        live = {id(o) for o in gc.get_objects() if isinstance(o, BatchedDynamicEmbeddingTables)}
        assert live == {id(m) for m in get_dynamic_emb_module(again.dynamicemb_model)}, \
            f"{len(live)} dynamic modules alive after the second build"
    finally:
        gc.enable()
