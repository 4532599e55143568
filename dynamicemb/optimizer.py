"""The fused optimizer object of ``BatchedDynamicEmbeddingTables``: updates run in
backward, LR schedulers act on its ``param_groups``' ``lr``. Also upstream's names
``EmbOptimType`` and ``OptimizerArgs``.
"""

from dataclasses import asdict
from typing import List, Tuple

import torch

from dynamicemb._upstream import module_getattr
from dynamicemb.options import DynamicEmbOptimizerArgs, DynamicEmbOptimType

__all__ = ["DynamicEmbFusedOptimizer", "EmbOptimType", "OptimizerArgs", "get_optimizer_state_dim"]

#: Upstream dynamicemb's names (``from dynamicemb.optimizer import EmbOptimType``).
EmbOptimType = DynamicEmbOptimType
OptimizerArgs = DynamicEmbOptimizerArgs


def get_optimizer_state_dim(optimizer_type, dim: int, element_dtype: torch.dtype = torch.float32
                            ) -> int:
    """Optimizer-state columns a row of ``dim`` (>= 1) columns carries (upstream's);
    ``optimizer_type`` is an ``EmbOptimType`` (ours or FBGEMM's) or its name,
    ``element_dtype`` float32 only. Raises ``ValueError`` otherwise."""
    from dynamicemb.ops.interface import optimizer_state_dim  # ops imports this module

    if element_dtype != torch.float32:
        raise ValueError(f"optimizer states are float32 here, got element_dtype {element_dtype}")
    if int(dim) < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    return optimizer_state_dim(DynamicEmbOptimType.of(optimizer_type), int(dim))


class DynamicEmbFusedOptimizer(torch.optim.Optimizer):
    """One param group per physical table group: ``groups`` holds (placeholder
    parameters, table names, optimizer args) of each."""

    def __init__(self, groups: List[Tuple[List[torch.nn.Parameter], List[str], DynamicEmbOptimizerArgs]]):
        param_groups = []
        for placeholders, names, args in groups:
            settings = asdict(args)
            settings["optimizer"] = args.optimizer.name
            settings["lr"] = settings.pop("learning_rate")
            param_groups.append({"params": list(placeholders), "tables": list(names), **settings})
        super().__init__(param_groups, defaults={})

    def set_learning_rate(self, lr: float) -> None:
        """Sets ``lr`` of every group."""
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        for group in self.param_groups:
            group["lr"] = float(lr)

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to do: the update ran in backward. Evaluates ``closure`` if given."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: fused updates leave no gradients behind."""


# upstream's optimizer classes and checkpoint helpers: refused by name
__getattr__ = module_getattr(__name__, lazy={}, refused=(
    "BaseDynamicEmbeddingOptimizer", "SGDDynamicEmbeddingOptimizer",
    "AdamDynamicEmbeddingOptimizer", "AdaGradDynamicEmbeddingOptimizer",
    "RowWiseAdaGradDynamicEmbeddingOptimizer", "get_optimizer_ckpt_state_dim",
    "pad_optimizer_states_from_checkpoint", "truncate_optimizer_states_for_checkpoint"))
