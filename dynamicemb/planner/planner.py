"""``DynamicEmbeddingShardingPlanner``: TorchRec's planner, aware of dynamic tables."""

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm import get_local_size, get_topology_domain_multiple
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimatorFactory
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import (EmbeddingModuleShardingPlan, ModuleSharder, ParameterSharding,
                                       ShardingPlan, ShardingType)
from torchrec.distributed.utils import add_params_from_parameter_sharding, get_device_type
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from dynamicemb.embedding.fused_params import module_kwargs, with_precision

from dynamicemb.planner.estimators import DynamicEmbPerfConfig, DynamicEmbStorageEstimator
from dynamicemb.planner.types import (
    CUSTOMIZED_KERNEL,
    DynamicEmbParameterConstraints,
    dynamic_table_options,
    table_configs,
    to_dynamic_sharding,
)

__all__ = ["DynamicEmbeddingEnumerator", "DynamicEmbeddingShardingPlanner"]


def _is_dynamic(constraint: ParameterConstraints) -> bool:
    return isinstance(constraint, DynamicEmbParameterConstraints) and constraint.use_dynamicemb


#: ``EmbeddingShardingPlanner``'s positional parameters (upstream's, after eb_configs).
_POSITIONAL = ("topology", "batch_size", "enumerator", "storage_reservation", "proposer",
               "partitioner", "performance_model", "stats", "constraints", "debug")


def _planner_arguments(args: tuple, eb_configs, kwargs: Dict[str, Any]):
    """(eb_configs, keyword arguments) from TorchRec's or upstream's call form (configs first)."""
    if args and isinstance(args[0], (list, tuple)) and all(
            isinstance(c, BaseEmbeddingConfig) for c in args[0]):
        if eb_configs is not None:
            raise TypeError("eb_configs given twice (positionally and by keyword)")
        eb_configs, args = args[0], args[1:]
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"at most {len(_POSITIONAL)} positional arguments after eb_configs "
                        f"({', '.join(_POSITIONAL)}), got {len(args)}")
    kwargs = dict(kwargs)
    for name, value in zip(_POSITIONAL, args):
        if name in kwargs:
            raise TypeError(f"{name} given twice (positionally and by keyword)")
        kwargs[name] = value
    return eb_configs, kwargs


def _check_table_params(name: str, sharding: ParameterSharding, options,
                        sharders: List[ModuleSharder]) -> None:
    """Refuses at plan time the per-table params of a dynamic table's constraint
    (``cache_params``, ``output_dtype``, ...) that its kernel cannot honour."""
    for sharder in sharders:
        try:
            kwargs = module_kwargs(add_params_from_parameter_sharding(
                dict(sharder.fused_params or {}), sharding))
            with_precision([options], kwargs, [name])
        except (TypeError, ValueError) as err:
            raise type(err)(f"table {name!r}: {err}") from None


def _dynamic_sharders(sharders: List[ModuleSharder[nn.Module]], device: str) -> List[ModuleSharder]:
    """The sharders that build dynamic kernels (they offer ``customized_kernel``)."""
    return [s for s in sharders
            if CUSTOMIZED_KERNEL in s.compute_kernels(ShardingType.ROW_WISE.value, device)]


def _check_configs(eb_configs: Sequence[BaseEmbeddingConfig]) -> Dict[str, BaseEmbeddingConfig]:
    configs = list(eb_configs)
    if not all(isinstance(c, BaseEmbeddingConfig) for c in configs):
        raise ValueError("eb_configs must be TorchRec table configs (EmbeddingConfig / "
                         "EmbeddingBagConfig)")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"eb_configs names must be unique, got {names}")
    return {c.name: c for c in configs}


def _cross_check(given: Mapping[str, BaseEmbeddingConfig],
                 model: Mapping[str, BaseEmbeddingConfig]) -> None:
    """Raises unless every ``eb_configs`` entry is a model table of the same shape and dtype."""
    for name, config in given.items():
        if name not in model:
            raise ValueError(f"eb_configs names table {name!r}, which the model does not have "
                             f"(its tables: {sorted(model)})")
        for field in ("embedding_dim", "num_embeddings", "data_type"):
            if getattr(config, field) != getattr(model[name], field):
                raise ValueError(f"table {name!r}: eb_configs has {field}="
                                 f"{getattr(config, field)}, the model "
                                 f"{getattr(model[name], field)}")


class DynamicEmbeddingEnumerator(EmbeddingEnumerator):
    """TorchRec's ``EmbeddingEnumerator`` for dynamic tables (upstream's name and arguments):
    offers ``customized_kernel`` to the tables ``constraints`` make dynamic and to no other;
    ``estimator`` defaults to ``DynamicEmbPerfConfig`` and ``DynamicEmbStorageEstimator``.

    Example::

        enumerator = DynamicEmbeddingEnumerator(topology=topology, constraints=constraints)
        planner = DynamicEmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                                  enumerator=enumerator)
    """

    def __init__(self, topology: Topology, batch_size: Optional[int] = 512,
                 constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 estimator=None, use_exact_enumerate_order: Optional[bool] = False) -> None:
        if estimator is None:
            estimator = [
                EmbeddingPerfEstimatorFactory.create_with_config(
                    DynamicEmbPerfConfig(), topology=topology, constraints=constraints),
                DynamicEmbStorageEstimator(topology=topology, constraints=constraints),
            ]
        super().__init__(topology=topology, batch_size=batch_size if batch_size is not None else 512,
                         constraints=constraints, estimator=estimator,
                         use_exact_enumerate_order=use_exact_enumerate_order)
        self._dynamic_tables = {name for name, c in (constraints or {}).items() if _is_dynamic(c)}

    def _filter_compute_kernels(self, name: str, allowed_compute_kernels: List[str], sharding_type: str) -> List[str]:
        kernels = super()._filter_compute_kernels(name, allowed_compute_kernels, sharding_type)
        if name in self._dynamic_tables:
            return [k for k in kernels if k == CUSTOMIZED_KERNEL]
        return [k for k in kernels if k != CUSTOMIZED_KERNEL]


class DynamicEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """Drop-in for TorchRec's ``EmbeddingShardingPlanner``.

    Tables with ``DynamicEmbParameterConstraints(use_dynamicemb=True)`` get the
    ``customized_kernel`` (row- or table-wise), are charged their hash tables' bytes
    (``DynamicEmbStorageEstimator``) and get a ``DynamicEmbParameterSharding`` with their
    options, ``dim`` and ``max_capacity`` filled from the model's configs (the constraints given
    are not modified). Other tables are planned as TorchRec would; a topology too small raises
    TorchRec's ``PlannerError``. Give the dynamic sharders to ``plan``/``collective_plan`` and DMP.

    Args:
        eb_configs: optional, upstream's first argument (positional or keyword): the model's
            table configs; ``plan`` checks the model's tables against them (name,
            ``embedding_dim``, ``num_embeddings``, ``data_type``).
        topology, batch_size, constraints: as TorchRec's planner; the default topology is
            TorchRec's (the default group's world size, ``LOCAL_WORLD_SIZE`` ranks per node).
        enumerator: a ``DynamicEmbeddingEnumerator`` (the default).
        storage_reservation, proposer, partitioner, performance_model, stats, debug, and
            TorchRec's other keywords: as ``EmbeddingShardingPlanner``'s, in its order.

    Example::

        constraints = {"items": DynamicEmbParameterConstraints(
            use_dynamicemb=True, sharding_types=["row_wise"],
            dynamicemb_options=DynamicEmbTableOptions())}  # dim, max_capacity: from the config
        planner = DynamicEmbeddingShardingPlanner(topology, constraints=constraints)
        plan = planner.collective_plan(model, sharders)
    """

    def __init__(self, *args: Any, eb_configs: Optional[Sequence[BaseEmbeddingConfig]] = None,
                 **kwargs: Any) -> None:
        eb_configs, kwargs = _planner_arguments(args, eb_configs, kwargs)
        self._eb_configs = None if eb_configs is None else _check_configs(eb_configs)
        topology: Optional[Topology] = kwargs.pop("topology", None)
        batch_size: Optional[int] = kwargs.pop("batch_size", None)
        enumerator = kwargs.pop("enumerator", None)
        constraints: Optional[Dict[str, ParameterConstraints]] = kwargs.pop("constraints", None)
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
            enumerator = DynamicEmbeddingEnumerator(topology=topology, batch_size=batch_size,
                                                    constraints=constraints)
        elif not isinstance(enumerator, DynamicEmbeddingEnumerator) and self._dynamic_constraints:
            raise ValueError(
                f"enumerator must be a DynamicEmbeddingEnumerator when tables are dynamic "
                f"(a {type(enumerator).__name__} would offer customized_kernel to any table "
                f"and charge hash tables as dense weights)")
        super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                         constraints=constraints, **kwargs)

    def plan(self, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """TorchRec's plan, dynamic tables' entries made ``DynamicEmbParameterSharding`` before
        ``collective_plan`` broadcasts it.

        Raises:
            ValueError: a dynamic table's ``dim`` or ``max_capacity`` differs from its config; the
                model's configs differ from ``eb_configs``; sharder fused params or a dynamic
                table's constraint (``cache_params``, ``output_dtype``, ...) hold a value dynamic
                tables cannot honour.
        """
        if self._eb_configs is not None:
            _cross_check(self._eb_configs, table_configs(module))
        if self._dynamic_constraints:
            for sharder in _dynamic_sharders(sharders, self._topology.compute_device):
                module_kwargs(sharder.fused_params)  # what the dynamic kernels are built with
        for name, constraint in self._dynamic_constraints.items():  # as given, for this module
            constraint.dynamicemb_options = self._declared_options[name]
        options = dynamic_table_options(self._dynamic_constraints, module)
        for name, table_options in options.items():
            self._dynamic_constraints[name].dynamicemb_options = table_options
        plan = super().plan(module, sharders)
        dynamic_sharders = _dynamic_sharders(sharders, self._topology.compute_device)
        for module_plan in plan.plan.values():
            if not isinstance(module_plan, EmbeddingModuleShardingPlan):
                continue
            for name, sharding in list(module_plan.items()):
                if name in options:
                    module_plan[name] = to_dynamic_sharding(sharding, options[name])
                    _check_table_params(name, sharding, options[name], dynamic_sharders)
        return plan
