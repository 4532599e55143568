"""HugeCTR plan files <-> TorchRec ``ShardingPlan``s.

Lookup ``i`` is the ``i``-th feature of ``model_lookups``; a table is placed as its lookups
are (they must agree): ``dp`` -> ``data_parallel`` (static tables only); ``mp`` listed by one
GPU -> ``table_wise`` on it; ``mp`` with shards ``0..N-1``, N = world size -> ``row_wise`` (by
key hash for dynamic tables, TorchRec's blocks for static ones). Static tables get the
``fused`` kernel; dynamic ones (``use_dynamicemb=True`` in ``constraints``) the planner's
``DynamicEmbParameterSharding``.
"""

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

from dynamicemb.plan.format import LookupPlacement, PlanFile, load_plan
from dynamicemb.planner.types import dynamic_table_options, to_dynamic_sharding

__all__ = ["Lookup", "from_sharding_plan", "model_lookups", "to_sharding_plan"]

STATIC_KERNEL = "fused"
_KIND_OF = {
    ShardingType.DATA_PARALLEL.value: "data_parallel",
    ShardingType.TABLE_WISE.value: "table_wise",
    ShardingType.ROW_WISE.value: "row_wise",
}


@dataclass(frozen=True)
class Lookup:
    """One feature of one embedding module: what a plan file's lookup index names."""

    module: str  # the module's fully qualified name in the model
    feature: str
    table: str


def _embedding_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(fqn, module) of the EC/EBC modules of ``model``, in ``named_modules`` order."""
    kinds = (EmbeddingCollection, EmbeddingBagCollection)
    found = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, kinds)]
    if not found:
        raise ValueError("the model has no EmbeddingCollection or EmbeddingBagCollection")
    return found


def _configs(module: nn.Module):
    if isinstance(module, EmbeddingCollection):
        return module.embedding_configs()
    return module.embedding_bag_configs()


def model_lookups(model: nn.Module, lookups: Optional[Sequence[str]] = None) -> List[Lookup]:
    """The model's lookups in plan-file order.

    Args:
        model: a model holding EmbeddingCollection / EmbeddingBagCollection modules.
        lookups: feature names, lookup ``i`` first (``"module.fqn:feature"`` for a feature in
            several modules); default: every feature, by module, config and feature order.

    Raises:
        ValueError: an unknown, ambiguous or repeated feature name.
    """
    every = [Lookup(fqn, feature, config.name)
             for fqn, module in _embedding_modules(model)
             for config in _configs(module) for feature in config.feature_names]
    if lookups is None:
        return every
    by_name: Dict[str, List[Lookup]] = {}
    for lookup in every:
        by_name.setdefault(lookup.feature, []).append(lookup)
        by_name.setdefault(f"{lookup.module}:{lookup.feature}", []).append(lookup)
    chosen = []
    for i, name in enumerate(lookups):
        matches = by_name.get(name, [])
        if not matches:
            raise ValueError(f"lookup {i}: the model has no feature {name!r}")
        if len(matches) > 1:
            raise ValueError(
                f"lookup {i}: feature {name!r} is in several modules "
                f"({[m.module for m in matches]}); name it as 'module:feature'")
        if matches[0] in chosen:
            raise ValueError(f"lookup {i}: feature {name!r} is listed twice")
        chosen.append(matches[0])
    return chosen


def _table_placements(plan: PlanFile, lookups: List[Lookup]
                      ) -> Dict[Tuple[str, str], LookupPlacement]:
    """(module, table) -> the placement of its lookups (which must agree)."""
    placements = plan.placements(num_lookups=len(lookups))
    tables: Dict[Tuple[str, str], Tuple[int, LookupPlacement]] = {}
    for i, lookup in enumerate(lookups):
        key = (lookup.module, lookup.table)
        placement = placements[i]
        if key in tables:
            first, seen = tables[key]
            if (seen.kind, seen.ranks) != (placement.kind, placement.ranks):
                raise ValueError(
                    f"lookups {first} and {i} use table {lookup.table!r} but are placed "
                    f"differently ({seen.kind} on GPUs {list(seen.ranks)} and "
                    f"{placement.kind} on GPUs {list(placement.ranks)}): a table is "
                    "sharded one way")
        else:
            tables[key] = (i, placement)
    return {key: placement for key, (_, placement) in tables.items()}


def _helper(table: str, placement: LookupPlacement, world_size: int, dynamic: bool):
    """The ``torchrec.distributed.sharding_plan`` helper for one table."""
    if placement.kind == "data_parallel":
        if dynamic:
            raise ValueError(
                f"table {table!r} is dynamic but placed data parallel (dp): a hash table "
                "grows per rank and cannot be replicated; put it in an mp group")
        return data_parallel()
    if placement.kind == "table_wise":
        return table_wise(rank=placement.ranks[0], compute_kernel=STATIC_KERNEL)
    if tuple(placement.ranks) != tuple(range(world_size)):
        raise ValueError(
            f"table {table!r} is row-wise over GPUs {list(placement.ranks)}: only a row-wise "
            f"sharding over all {world_size} GPUs in order (shard id = GPU) is supported")
    return row_wise(compute_kernel=STATIC_KERNEL)


def to_sharding_plan(
    plan,
    model: nn.Module,
    *,
    lookups: Optional[Sequence[str]] = None,
    constraints: Optional[Mapping[str, ParameterConstraints]] = None,
    device: str = "cpu",
    local_world_size: Optional[int] = None,
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]] = None,
) -> ShardingPlan:
    """The TorchRec ``ShardingPlan`` of a HugeCTR plan file, one module plan per EC/EBC module.

    Args:
        plan: a ``PlanFile``, or anything ``load_plan`` takes (path, JSON, list).
        model: the unsharded model (its tables may be on ``meta``).
        lookups: feature names of the plan's lookups (``model_lookups``).
        constraints: the planner's constraints; ``use_dynamicemb=True`` tables are dynamic.
        device: the compute device type, ``"cpu"`` or ``"cuda"``.
        local_world_size: ranks per node (default: TorchRec's ``get_local_size``); CUDA
            shards go to device ``rank % local_world_size``.
        sharders: the sharders DMP gets (default: TorchRec's for each module type).

    Raises:
        ValueError: an invalid plan, or one the mapping above cannot express.

    Example::

        plan = to_sharding_plan("plan.json", model, constraints=constraints)
        dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)
    """
    plan = plan if isinstance(plan, PlanFile) else load_plan(plan)
    world_size = plan.num_gpus
    resolved = model_lookups(model, lookups)
    placements = _table_placements(plan, resolved)
    dynamic = dynamic_table_options(constraints, model)  # dim, max_capacity from the configs
    by_type = {s.module_type: s for s in (sharders or [])}
    module_plans = {}
    for fqn, module in _embedding_modules(model):
        per_table = {}
        for config in _configs(module):
            placement = placements.get((fqn, config.name))
            if placement is None:
                raise ValueError(f"table {config.name!r} of module {fqn!r} has no lookup in "
                                 "the plan: list one of its features in `lookups`")
            per_table[config.name] = _helper(config.name, placement, world_size,
                                             config.name in dynamic)
        module_plan = construct_module_sharding_plan(
            module, per_table, sharder=by_type.get(type(module)),
            local_size=local_world_size or get_local_size(world_size), world_size=world_size,
            device_type=device)
        for name, options in dynamic.items():
            if name in module_plan:
                module_plan[name] = to_dynamic_sharding(module_plan[name], options)
        module_plans[fqn] = module_plan
    return ShardingPlan(module_plans)


def _placement_of(table: str, sharding: ParameterSharding, world_size: int) -> LookupPlacement:
    kind = _KIND_OF.get(sharding.sharding_type)
    if kind is None:
        raise ValueError(
            f"table {table!r} is {sharding.sharding_type}: a plan file expresses only "
            "data_parallel, table_wise and row_wise shardings")
    ranks = tuple(sharding.ranks) if sharding.ranks else tuple(range(world_size))
    if kind == "row_wise" and ranks != tuple(range(world_size)):
        raise ValueError(
            f"table {table!r} is row-wise over ranks {list(ranks)}: a plan file expresses "
            f"row-wise shardings over all {world_size} ranks in order")
    if kind == "data_parallel":
        ranks = tuple(range(world_size))
    if kind == "row_wise" and world_size == 1:  # one shard: a plan file's table-wise
        kind = "table_wise"
    return LookupPlacement(kind=kind, ranks=ranks, group=0)


def from_sharding_plan(
    sharding_plan: ShardingPlan,
    model: nn.Module,
    *,
    lookups: Optional[Sequence[str]] = None,
    world_size: Optional[int] = None,
) -> PlanFile:
    """The HugeCTR plan file of a ``ShardingPlan``; ``to_sharding_plan`` of it gives it back.

    Args:
        sharding_plan: a plan of the model's EC/EBC modules.
        model: the model it was made for.
        lookups: feature names of the plan's lookups (``model_lookups``).
        world_size: the number of GPUs (default: one more than the highest rank).

    Raises:
        ValueError: naming a table with no sharding or one a plan file cannot express
            (column-wise, grid, row-wise over some ranks only, ...).
    """
    resolved = model_lookups(model, lookups)
    if world_size is None:
        world_size = 1 + max((r for mp in sharding_plan.plan.values()
                              if isinstance(mp, EmbeddingModuleShardingPlan)
                              for s in mp.values() for r in (s.ranks or [0])), default=0)
    placements = {}
    for i, lookup in enumerate(resolved):
        module_plan = sharding_plan.plan.get(lookup.module)
        if module_plan is None or lookup.table not in module_plan:
            raise ValueError(f"table {lookup.table!r} of module {lookup.module!r} has no "
                             "sharding in the plan")
        placements[i] = _placement_of(lookup.table, module_plan[lookup.table], world_size)
    return PlanFile.from_placements(placements, world_size)
