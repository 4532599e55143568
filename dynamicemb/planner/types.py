"""Plan-side types: constraints that mark a table dynamic, and the parameter sharding
that carries its options to the sharded module."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ParameterSharding, ShardingType

from dynamicemb.options import DynamicEmbTableOptions
from dynamicemb.types import row_dtype_of_data_type

__all__ = [
    "DYNAMICEMB_OPTIONS_KEY",
    "DYNAMIC_SHARDING_TYPES",
    "DynamicEmbOptionsRef",
    "DynamicEmbParameterConstraints",
    "DynamicEmbParameterSharding",
    "dynamic_table_options",
    "resolve_options",
    "table_configs",
    "table_options",
    "to_dynamic_sharding",
]

# Fused-param key under which a dynamic table's options reach its kernel.
DYNAMICEMB_OPTIONS_KEY = "dynamicemb_options"
CUSTOMIZED_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
DYNAMIC_SHARDING_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_WISE.value)


class DynamicEmbOptionsRef:
    """A dynamic table's options as a hashable fused-param value.

    Every reference compares equal, so TorchRec (which groups tables by fused params) puts all
    dynamic tables of a sharding in one kernel, which groups them by their options itself.
    """

    __slots__ = ("options",)

    def __init__(self, options: DynamicEmbTableOptions) -> None:
        self.options = options

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DynamicEmbOptionsRef)

    def __hash__(self) -> int:
        return hash(DynamicEmbOptionsRef)

    def __repr__(self) -> str:
        return f"DynamicEmbOptionsRef({self.options!r})"


def check_dynamic_sharding_type(sharding_type: str, table: str = "") -> None:
    """Raises unless a dynamic table may use ``sharding_type`` (row- or table-wise)."""
    if sharding_type == ShardingType.DATA_PARALLEL.value:
        raise ValueError(
            f"dynamic table {table!r} cannot be data_parallel: a hash table grows per rank "
            f"and cannot be replicated; use one of {list(DYNAMIC_SHARDING_TYPES)}")
    if sharding_type not in DYNAMIC_SHARDING_TYPES:
        raise ValueError(
            f"dynamic table {table!r}: sharding type {sharding_type!r} is not supported; "
            f"use one of {list(DYNAMIC_SHARDING_TYPES)}")


@dataclass
class DynamicEmbParameterSharding(ParameterSharding):
    """``ParameterSharding`` of a dynamic table (``compute_kernel="customized_kernel"``).

    Args:
        dynamicemb_options: the table's options; ``dim`` must equal its ``embedding_dim``, and
            each rank's ``max_capacity`` is its share of ``num_embeddings``.
    """

    dynamicemb_options: Optional[DynamicEmbTableOptions] = None

    def __post_init__(self) -> None:
        if self.dynamicemb_options is None:
            raise ValueError("DynamicEmbParameterSharding needs dynamicemb_options")
        if self.compute_kernel != CUSTOMIZED_KERNEL:
            raise ValueError(
                f"dynamic tables use compute_kernel={CUSTOMIZED_KERNEL!r}, got {self.compute_kernel!r}")
        check_dynamic_sharding_type(self.sharding_type)

    def get_additional_fused_params(self) -> Dict[str, Any]:
        """What TorchRec merges into this table's fused params (customized kernels only)."""
        return {DYNAMICEMB_OPTIONS_KEY: DynamicEmbOptionsRef(self.dynamicemb_options)}


def to_dynamic_sharding(
    sharding: ParameterSharding, options: DynamicEmbTableOptions
) -> DynamicEmbParameterSharding:
    """A dynamic copy of a table's ``ParameterSharding`` (from a planner or the
    ``torchrec.distributed.sharding_plan`` helpers), with the same placement.

    Example::

        plan = construct_module_sharding_plan(ebc, {"t": row_wise()}, world_size=2, ...)
        plan["t"] = to_dynamic_sharding(plan["t"], DynamicEmbTableOptions(dim=16, max_capacity=1 << 20))
    """
    fields = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
    fields["compute_kernel"] = CUSTOMIZED_KERNEL
    return DynamicEmbParameterSharding(**fields, dynamicemb_options=options)


@dataclass
class DynamicEmbParameterConstraints(ParameterConstraints):
    """``ParameterConstraints`` that can make a table dynamic.

    Args:
        use_dynamicemb: plan the table as a dynamic (hash-table) table.
        dynamicemb_options: its options (default ``DynamicEmbTableOptions()``). ``dim`` and
            ``max_capacity`` left None are filled from the table's ``embedding_dim`` and
            ``num_embeddings`` (``resolve_options``); a differing value is a ``ValueError``.

    A dynamic table may be ``row_wise`` (keys routed by ``owner_rank``) or ``table_wise``, with
    ``compute_kernels`` ``["customized_kernel"]``; anything else is refused.
    """

    use_dynamicemb: bool = False
    dynamicemb_options: Optional[DynamicEmbTableOptions] = None

    def __post_init__(self) -> None:
        if not self.use_dynamicemb:
            return
        if self.dynamicemb_options is None:  # upstream's default: default options
            self.dynamicemb_options = DynamicEmbTableOptions()
        if self.sharding_types is None:
            self.sharding_types = list(DYNAMIC_SHARDING_TYPES)
        for sharding_type in self.sharding_types:
            check_dynamic_sharding_type(sharding_type)
        if self.compute_kernels not in (None, [CUSTOMIZED_KERNEL]):
            raise ValueError(
                f"dynamic tables use compute_kernels=[{CUSTOMIZED_KERNEL!r}], got {self.compute_kernels}")
        self.compute_kernels = [CUSTOMIZED_KERNEL]


def resolve_options(options: DynamicEmbTableOptions, table: str, embedding_dim: int,
                    num_embeddings: int, data_type: Any = None) -> DynamicEmbTableOptions:
    """A dynamic table's options with ``dim``, ``max_capacity`` (the global capacity) and
    ``embedding_dtype`` taken from its TorchRec config where they are None (a config's
    FP32, the default, leaves ``embedding_dtype`` to the options); ``options`` itself
    when nothing is missing.

    Args:
        options: the options a constraint (or ``to_dynamic_sharding``) gave.
        table: the table's name, for messages.
        embedding_dim, num_embeddings, data_type: the table's config fields (``data_type``
            FP32, FP16 or BF16; None: not checked).

    Raises:
        ValueError: a set field differs from the config (a 16-bit ``data_type`` from
            ``embedding_dtype``), or ``data_type`` is another.
    """
    fills = {}
    if data_type is not None:  # FP32 is every config's default: options may set 16 bits
        dtype = row_dtype_of_data_type(data_type, table)
        if options.embedding_dtype is None and dtype != torch.float32:
            fills["embedding_dtype"] = dtype
        elif dtype != torch.float32 and options.row_dtype != dtype:
            raise ValueError(
                f"table {table!r}: dynamicemb_options.embedding_dtype={options.row_dtype} but "
                f"data_type={getattr(data_type, 'name', data_type)} in the table's config "
                f"(leave embedding_dtype unset to take the config's)")
    for field, config_field, value in (("dim", "embedding_dim", embedding_dim),
                                       ("max_capacity", "num_embeddings", num_embeddings)):
        given = getattr(options, field)
        if given is None:
            fills[field] = value
        elif given != value:
            raise ValueError(
                f"table {table!r}: dynamicemb_options.{field}={given} but {config_field}={value} "
                f"in the table's config (leave {field} unset to take the config's)")
    return dataclasses.replace(options, **fills) if fills else options


def table_options(table: Any) -> DynamicEmbTableOptions:
    """The dynamicemb options in a ``customized_kernel`` ``ShardedEmbeddingTable``'s fused
    params; ``ValueError`` if it has none."""
    ref = (table.fused_params or {}).get(DYNAMICEMB_OPTIONS_KEY)
    if ref is None:
        raise ValueError(
            f"table {table.name!r} uses customized_kernel without dynamicemb options; "
            f"plan it with DynamicEmbeddingShardingPlanner or to_dynamic_sharding")
    return ref.options


def table_configs(module: nn.Module) -> Dict[str, Any]:
    """name -> config of every EmbeddingCollection / EmbeddingBagCollection table in ``module``."""
    configs: Dict[str, Any] = {}
    for child in module.modules():
        for getter in ("embedding_configs", "embedding_bag_configs"):
            if callable(getattr(child, getter, None)):
                configs.update((config.name, config) for config in getattr(child, getter)())
    return configs


def dynamic_table_options(constraints: Optional[Mapping[str, ParameterConstraints]],
                          module: nn.Module) -> Dict[str, DynamicEmbTableOptions]:
    """Options of the tables ``constraints`` make dynamic, completed from ``module``'s table
    configs (``resolve_options``; tables may be on ``meta``). A constraint naming no table of
    ``module`` keeps its options as given."""
    configs = table_configs(module)
    out = {}
    for name, constraint in (constraints or {}).items():
        if not (isinstance(constraint, DynamicEmbParameterConstraints) and constraint.use_dynamicemb):
            continue
        config = configs.get(name)
        out[name] = (constraint.dynamicemb_options if config is None else resolve_options(
            constraint.dynamicemb_options, name, config.embedding_dim, config.num_embeddings,
            config.data_type))
    return out
