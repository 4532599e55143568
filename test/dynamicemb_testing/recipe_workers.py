"""Rank bodies of the save/resume recipe test: the recipe is executed from the docs."""

import os
import re

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dynamicemb_testing.checkpoint_workers import FEATURES, global_state, local_batch
from dynamicemb import DynamicEmbInitializerArgs, DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard import DynamicEmbeddingCollectionSharder

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "CHECKPOINTS.md")


def recipe() -> dict:
    """``save_checkpoint`` and ``load_checkpoint`` exactly as the docs write them."""
    text = open(DOC).read()
    block = re.search(r"```python\n(.*?)```", text[text.index("## Save and resume"):], re.S).group(1)
    names: dict = {}
    exec(compile(block, DOC, "exec"), names)
    return names


class Model(nn.Module):
    """A dynamic row-wise table ("rw": features f, g), a static row-wise table ("st":
    feature h) and a dense layer over every looked-up row."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="rw", num_embeddings=512, embedding_dim=8, feature_names=["f", "g"]),
            EmbeddingConfig(name="st", num_embeddings=256, embedding_dim=8, feature_names=["h"])],
            device=torch.device("meta"))
        self.dense = nn.Linear(8, 1)

    def forward(self, kjt):
        out = self.ec(kjt)
        return sum(self.dense(out[f].values()).sum() for f in FEATURES)


def build(world_size: int):
    torch.manual_seed(0)
    model = Model()
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}
    sharder = DynamicEmbeddingCollectionSharder(fused_params=fused)
    plan = construct_module_sharding_plan(
        model.ec, {"rw": row_wise(compute_kernel="fused"), "st": row_wise(compute_kernel="fused")},
        sharder=sharder, local_size=get_local_size(world_size), world_size=world_size, device_type="cpu")
    plan["rw"] = to_dynamic_sharding(plan["rw"], DynamicEmbTableOptions(
        dim=8, max_capacity=512, initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1)))
    dmp = DistributedModelParallel(model, plan=ShardingPlan({"ec": plan}), sharders=[sharder],
                                   device=torch.device("cpu"))
    dense_optimizer = torch.optim.Adam(
        [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], lr=0.01)
    return dmp, dense_optimizer


def _train(dmp, dense_optimizer, steps, rank, world_size):
    losses = []
    for step in steps:
        dense_optimizer.zero_grad()
        loss = dmp(local_batch(step, rank, world_size))
        loss.backward()
        dense_optimizer.step()
        dmp.fused_optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _everything(dmp):
    """Dense parameters, static rows and fused state (local shards), dynamic rows."""
    state = {k: (v.local_shards()[0].tensor.clone() if hasattr(v, "local_shards") else v.clone())
             for k, v in dmp.state_dict().items()}
    fused = dmp.fused_optimizer.state_dict()["state"]
    for name, per_param in fused.items():
        for key, value in per_param.items():
            if hasattr(value, "local_shards"):
                state[f"fused:{name}:{key}"] = value.local_shards()[0].tensor.clone()
    return state, global_state(dmp, ("rw",))


def straight_run(rank: int, world_size: int, path: str, record: str) -> None:
    """10 steps, the recipe's save, 10 more steps: the uninterrupted run."""
    dmp, dense_optimizer = build(world_size)
    _train(dmp, dense_optimizer, range(10), rank, world_size)
    recipe()["save_checkpoint"](path, dmp, dense_optimizer)
    losses = _train(dmp, dense_optimizer, range(10, 20), rank, world_size)
    torch.save({"losses": losses, "state": _everything(dmp),
                "adam": dense_optimizer.state_dict()}, f"{record}.{rank}")


def resumed_run(rank: int, world_size: int, path: str, record: str) -> None:
    """New processes: the recipe's load, 10 steps; bit-identical to the straight run."""
    dmp, dense_optimizer = build(world_size)
    _train(dmp, dense_optimizer, range(30, 33), rank, world_size)  # moved away first
    recipe()["load_checkpoint"](path, dmp, dense_optimizer)
    losses = _train(dmp, dense_optimizer, range(10, 20), rank, world_size)
    expected = torch.load(f"{record}.{rank}", weights_only=False)
    assert torch.equal(losses, expected["losses"])
    (dense, dynamic), (dense_ref, dynamic_ref) = _everything(dmp), expected["state"]
    assert sorted(dense) == sorted(dense_ref) and any(k.startswith("fused:") for k in dense)
    for key in dense:
        assert torch.equal(dense[key], dense_ref[key]), key
    for name in dynamic:
        for x, y in zip(dynamic[name][0] + dynamic[name][1], dynamic_ref[name][0] + dynamic_ref[name][1]):
            assert torch.equal(x, y), name
    for group, ref in zip(dense_optimizer.state_dict()["state"].values(),
                          expected["adam"]["state"].values()):
        for key in group:
            assert torch.equal(torch.as_tensor(group[key]), torch.as_tensor(ref[key])), key
