"""Every Python block of the README runs (```` ```python ````; the GPU-only recipe is a
```` ```py ```` block, run by ``test/cuda/test_cuda_graph.py``'s stand-in and by
``make gpu-check``).

Blocks run in order in one namespace, in a subprocess with a one-rank gloo group.
A block that continues a setting the README describes in prose (a model, its
sharders, the next batch) gets that setting from ``CONTEXT`` first, keyed by a line
of the block; the block's own lines run unchanged.
"""

import os
import re
import textwrap

from dynamicemb_testing.dist_utils import free_port
from dynamicemb_testing.scripts import ROOT, run_python

# What the README's prose supplies around a fragment: keyed by a line of the block.
CONTEXT = {
    "plan = DynamicEmbeddingShardingPlanner(": """
        import torch
        from torch import nn
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.planner import Topology
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        class Model(nn.Module):
            def __init__(self, names):
                super().__init__()
                self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                    name=n, embedding_dim=128, num_embeddings=rows, feature_names=[f"f_{n}"])
                    for n, rows in names.items()], device=torch.device("meta"))

        model = Model({"user_id": 100_000, "country": 300})
        fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.01}
        topology = Topology(world_size=1, compute_device="cpu")
    """,
    'plan_file = load_plan("dp_and_localized_plan.json")': """
        from dynamicemb.plan import dp_and_localized
        with open("dp_and_localized_plan.json", "w") as f:
            f.write(dp_and_localized([100_000, 300], num_gpus=1).to_json())
        model = Model({"item_id": 100_000, "small": 300})
    """,
    "tables.prefetch(next_indices, next_offsets)": """
        next_indices = torch.tensor([7, 2**40, -5, 7])
        next_offsets = torch.tensor([0, 2, 4])
    """,
}

PRELUDE = """
import os, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["README_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
"""


def python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_python_blocks_run(tmp_path):
    blocks = python_blocks()
    assert len(blocks) >= 5
    parts = [PRELUDE]
    for block in blocks:
        for key, setup in CONTEXT.items():
            if key in block:
                parts.append(textwrap.dedent(setup))
        parts.append(block)
    script = tmp_path / "readme_blocks.py"
    script.write_text("\n".join(parts))
    done = run_python([script], cwd=str(tmp_path), timeout=600,
                      env=dict(README_PORT=str(free_port()), PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-4000:]


def test_every_fragment_context_is_used():
    text = "".join(python_blocks())
    assert all(key in text for key in CONTEXT), [k for k in CONTEXT if k not in text]
