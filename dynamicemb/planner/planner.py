"""``DynamicEmbeddingShardingPlanner``: TorchRec's planner, aware of dynamic tables."""

import copy
from typing import Dict, List, Optional

import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm import get_local_size, get_topology_domain_multiple
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ModuleSharder, ShardingPlan
from torchrec.distributed.utils import get_device_type

from dynamicemb.planner.estimators import DynamicEmbPerfConfig, DynamicEmbStorageEstimator
from dynamicemb.planner.types import (
    CUSTOMIZED_KERNEL,
    DynamicEmbParameterConstraints,
    dynamic_table_options,
    to_dynamic_sharding,
)

__all__ = ["DynamicEmbeddingShardingPlanner"]


def _is_dynamic(constraint: ParameterConstraints) -> bool:
    return isinstance(constraint, DynamicEmbParameterConstraints) and constraint.use_dynamicemb


class _DynamicEmbEnumerator(EmbeddingEnumerator):
    """Offers ``customized_kernel`` to dynamic tables only (TorchRec does not guard it)."""

    def __init__(self, *args, dynamic_tables=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dynamic_tables = set(dynamic_tables)

    def _filter_compute_kernels(self, name: str, allowed_compute_kernels: List[str], sharding_type: str) -> List[str]:
        kernels = super()._filter_compute_kernels(name, allowed_compute_kernels, sharding_type)
        if name in self._dynamic_tables:
            return [k for k in kernels if k == CUSTOMIZED_KERNEL]
        return [k for k in kernels if k != CUSTOMIZED_KERNEL]


class DynamicEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """Drop-in for TorchRec's ``EmbeddingShardingPlanner``.

    Tables with ``DynamicEmbParameterConstraints(use_dynamicemb=True, ...)`` are
    planned with the ``customized_kernel`` (row-wise or table-wise), their hash
    tables' bytes are counted against the topology (``DynamicEmbStorageEstimator``),
    and the plan gives them a ``DynamicEmbParameterSharding`` carrying their options.
    Options' ``dim`` and ``max_capacity`` left ``None`` are filled from the table's
    config when ``plan`` sees the model (a set value that differs is a ``ValueError``);
    the constraints given are not modified.
    Other tables are planned as TorchRec would. A topology too small raises
    TorchRec's ``PlannerError``. Pass the dynamic sharders
    (``dynamicemb.shard``) to ``plan``/``collective_plan`` and to DMP.

    Args:
        topology, batch_size, constraints: as TorchRec's planner. The default
            topology is TorchRec's: the default process group's world size, nodes of
            ``LOCAL_WORLD_SIZE`` ranks (``get_local_size``), CUDA if available.
        enumerator: default: TorchRec's enumerator with the dynamic estimators.
        **kwargs: the other ``EmbeddingShardingPlanner`` arguments.

    Example::

        constraints = {"items": DynamicEmbParameterConstraints(
            use_dynamicemb=True, sharding_types=["row_wise"],
            dynamicemb_options=DynamicEmbTableOptions())}  # dim, max_capacity: from the config
        planner = DynamicEmbeddingShardingPlanner(topology, constraints=constraints)
        plan = planner.collective_plan(model, sharders)
    """

    def __init__(self, topology: Optional[Topology] = None, batch_size: Optional[int] = None,
                 enumerator=None, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 **kwargs) -> None:
        if topology is None:
            world_size = dist.get_world_size()
            topology = Topology(
                world_size=world_size, local_world_size=get_local_size(world_size),
                compute_device=get_device_type(), pod_size=get_topology_domain_multiple())
        # Own copies of the dynamic constraints: plan() completes their options in place,
        # where the estimators (which hold this dict) read them.
        if constraints is not None:
            constraints = {name: copy.copy(c) if _is_dynamic(c) else c for name, c in constraints.items()}
        self._dynamic_constraints = {name: c for name, c in (constraints or {}).items() if _is_dynamic(c)}
        self._declared_options = {name: c.dynamicemb_options for name, c in self._dynamic_constraints.items()}
        if enumerator is None:
            perf = EmbeddingPerfEstimatorFactory.create_with_config(
                DynamicEmbPerfConfig(), topology=topology, constraints=constraints)
            storage = DynamicEmbStorageEstimator(topology=topology, constraints=constraints)
            enumerator = _DynamicEmbEnumerator(
                topology=topology, batch_size=batch_size if batch_size is not None else 512,
                constraints=constraints, estimator=[perf, storage],
                dynamic_tables=self._dynamic_constraints)
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         constraints=constraints, **kwargs)

    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """TorchRec's plan, with dynamic tables' entries as ``DynamicEmbParameterSharding``
        (converted before ``collective_plan`` broadcasts it).

        Raises:
            ValueError: a dynamic table's ``dim`` or ``max_capacity`` differs from its
                config in ``module``.
        """
        for name, constraint in self._dynamic_constraints.items():  # as given, for this module
            constraint.dynamicemb_options = self._declared_options[name]
        options = dynamic_table_options(self._dynamic_constraints, module)
        for name, table_options in options.items():
            self._dynamic_constraints[name].dynamicemb_options = table_options
        plan = super().plan(module, sharders)
        for module_plan in plan.plan.values():
            if not isinstance(module_plan, EmbeddingModuleShardingPlan):
                continue
            for name, sharding in list(module_plan.items()):
                if name in options:
                    module_plan[name] = to_dynamic_sharding(sharding, options[name])
        return plan
