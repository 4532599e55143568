"""Upstream's ``dynamicemb.get_planner``: a ``DynamicEmbeddingShardingPlanner`` for the
default process group."""

from typing import Dict, Iterable, List, Mapping, Sequence

import torch

from dynamicemb._torchrec import require_torchrec

require_torchrec("dynamicemb.get_planner")

import torch.distributed as dist  # noqa: E402
from torchrec.distributed.comm import get_local_size  # noqa: E402
from torchrec.distributed.planner import ParameterConstraints, Topology  # noqa: E402
from torchrec.distributed.planner.storage_reservations import (  # noqa: E402
    HeuristicalStorageReservation,
)
from torchrec.distributed.types import BoundsCheckMode, ShardingType  # noqa: E402
from torchrec.modules.embedding_configs import BaseEmbeddingConfig  # noqa: E402

from dynamicemb.options import DynamicEmbTableOptions  # noqa: E402
from dynamicemb.planner import (  # noqa: E402
    DynamicEmbeddingEnumerator,
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterConstraints,
)

__all__ = ["PIPELINE_COMPUTE_KERNELS", "get_planner", "get_planner_constraints"]

#: pipeline type -> (compute kernels of data-parallel tables, of other TorchRec tables);
#: None leaves them to the planner.
PIPELINE_COMPUTE_KERNELS: Dict[str, tuple] = {
    "prefetch": (["dense"], ["fused_uvm_caching"]),
    "native": (["dense"], ["fused", "fused_uvm"]),
    "none": (None, None),
}


def get_planner_constraints(
    eb_configs: Sequence[BaseEmbeddingConfig],
    data_parallel_embedding_table_names: Iterable[str],
    dynamicemb_options_dict: Mapping[str, DynamicEmbTableOptions],
    pipeline_type: str = "none",
) -> Dict[str, ParameterConstraints]:
    """``get_planner``'s constraints (same arguments), by table name: data-parallel
    tables ``data_parallel``, the others ``row_wise`` (``DynamicEmbParameterConstraints``
    for dynamic ones); no bounds checks. ``ValueError``: an unknown ``pipeline_type``, a
    name not in ``eb_configs``, or a table both data-parallel and dynamic."""
    if pipeline_type not in PIPELINE_COMPUTE_KERNELS:
        raise ValueError(f"pipeline_type must be one of {sorted(PIPELINE_COMPUTE_KERNELS)}, "
                         f"got {pipeline_type!r}")
    data_parallel = set(data_parallel_embedding_table_names)
    names = {config.name for config in eb_configs}
    for what, given in (("data_parallel_embedding_table_names", data_parallel),
                        ("dynamicemb_options_dict", set(dynamicemb_options_dict))):
        if given - names:
            raise ValueError(f"{what} names tables that are not in eb_configs: "
                             f"{sorted(given - names)}")
    both = sorted(data_parallel & set(dynamicemb_options_dict))
    if both:
        raise ValueError(f"tables {both} are both data-parallel and dynamic; choose one")
    dense_kernels, fused_kernels = PIPELINE_COMPUTE_KERNELS[pipeline_type]
    constraints: Dict[str, ParameterConstraints] = {}
    for config in eb_configs:
        if config.name in data_parallel:
            constraints[config.name] = ParameterConstraints(
                sharding_types=[ShardingType.DATA_PARALLEL.value], compute_kernels=dense_kernels,
                bounds_check_mode=BoundsCheckMode.NONE)
        elif config.name in dynamicemb_options_dict:
            constraints[config.name] = DynamicEmbParameterConstraints(
                sharding_types=[ShardingType.ROW_WISE.value], bounds_check_mode=BoundsCheckMode.NONE,
                use_dynamicemb=True, dynamicemb_options=dynamicemb_options_dict[config.name])
        else:
            constraints[config.name] = ParameterConstraints(
                sharding_types=[ShardingType.ROW_WISE.value], compute_kernels=fused_kernels,
                bounds_check_mode=BoundsCheckMode.NONE)
    return constraints


def get_planner(
    eb_configs: List[BaseEmbeddingConfig],
    data_parallel_embedding_table_names: Iterable[str],
    dynamicemb_options_dict: Mapping[str, DynamicEmbTableOptions],
    device: torch.device,
    pipeline_type: str = "none",
    ddr_cap: int = 512 * 1024**3,
    intra_host_bw: float = 450e9,
    inter_host_bw: float = 25e9,
) -> DynamicEmbeddingShardingPlanner:
    """A planner for every rank of the default process group (upstream's call).

    Args:
        eb_configs: the model's table configs.
        data_parallel_embedding_table_names: tables replicated on every rank.
        dynamicemb_options_dict: table name -> options of a dynamic table.
        device: the ranks' compute device.
        pipeline_type: ``"none"``, ``"native"`` or ``"prefetch"`` (CUDA only): the
            compute kernels of TorchRec's own tables (``PIPELINE_COMPUTE_KERNELS``).
        ddr_cap, intra_host_bw, inter_host_bw: the topology's host bytes per rank and
            bandwidths (device memory: the CUDA device's).

    Returns:
        A ``DynamicEmbeddingShardingPlanner`` with a 5% heuristic storage reservation.

    Raises:
        RuntimeError: no default process group.
        ValueError: see ``get_planner_constraints``, or ``"prefetch"`` off CUDA.
    """
    device = torch.device(device)
    if pipeline_type == "prefetch" and device.type != "cuda":
        raise ValueError("pipeline_type='prefetch' puts TorchRec's tables on fused_uvm_caching, "
                         f"a CUDA kernel; use 'native' or 'none' on {device.type}")
    if not dist.is_initialized():
        raise RuntimeError("get_planner plans for the default process group: call "
                           "torch.distributed.init_process_group first")
    constraints = get_planner_constraints(eb_configs, data_parallel_embedding_table_names,
                                          dynamicemb_options_dict, pipeline_type)
    hbm_cap = (torch.cuda.get_device_properties(device).total_memory
               if device.type == "cuda" else None)
    topology = Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                        compute_device=device.type, hbm_cap=hbm_cap, ddr_cap=ddr_cap,
                        intra_host_bw=intra_host_bw, inter_host_bw=inter_host_bw)
    return DynamicEmbeddingShardingPlanner(
        eb_configs=eb_configs, topology=topology, constraints=constraints,
        enumerator=DynamicEmbeddingEnumerator(topology=topology, constraints=constraints),
        storage_reservation=HeuristicalStorageReservation(percentage=0.05))
