"""FBGEMM's and upstream's table keywords (and TorchRec fused params): each is honoured or
refused, never dropped. A keyword for a feature dynamic tables lack is accepted only at the
value that leaves it off; an unknown keyword is a ``TypeError``."""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from dynamicemb.options import DynamicEmbOptimizerArgs, DynamicEmbTableOptions
from dynamicemb.types import ROW_DTYPES

__all__ = ["OPTIMIZER_KEYWORDS", "check_tbe_keywords", "module_kwargs", "output_dtype_of",
           "with_precision"]

#: Keywords that make up ``DynamicEmbOptimizerArgs``.
OPTIMIZER_KEYWORDS = tuple(DynamicEmbOptimizerArgs.__dataclass_fields__)

#: Keywords accepted with any value: dynamic tables already do what they ask.
_ALWAYS_HONOURED = {
    "bounds_check_mode": "ids are raw keys, so no id is out of bounds",
    "prefetch_pipeline": "prefetch() is always safe (results equal no prefetch)",
    "use_index_dedup": "the module always deduplicates the ids of a batch",
    # upstream's planner sets it on every dynamic table and its tables ignore it too
    "enforce_hbm": "rows are placed by the options' local_hbm_for_values and caching",
}

#: keyword -> (the values that leave its feature off, why other values are refused).
_OFF_ONLY: Dict[str, Tuple[tuple, str]] = {
    "max_norm": ((0.0,), "row max-norm clipping is not implemented"),
    "momentum": ((0.9,), "it is LARS_SGD's, which dynamic tables do not support"),
    "eta": ((0.001,), "it is LARS_SGD's, which dynamic tables do not support"),
    "counter_based_regularization": ((None,), "counter-based regularization is not supported"),
    "cowclip_regularization": ((None,), "CowClip regularization is not supported"),
    "global_weight_decay": ((None,), "global weight decay is not supported"),
    "extra_optimizer_config": ((None,), "extra optimizer configs are not supported"),
    "optimizer_state_dtypes": ((None, {}), "optimizer states are float32"),
    "ensemble_mode": ((None,), "ensemble optimizers are not supported"),
    "emainplace_mode": ((None,), "EMA optimizers are not supported"),
    "uvm_non_rowwise_momentum": ((False,), "optimizer states live with their rows"),
    "uvm_host_mapped": ((False,), "host tiers are plain host memory"),
    "use_experimental_tbe": ((False,), "there is no experimental kernel"),
    "record_cache_metrics": ((None, False), "use cache_metrics() instead"),
    "gather_uvm_cache_stats": ((False,), "use cache_metrics() instead"),
    "stats_reporter_config": ((None,), "FBGEMM's stats reporter is not supported"),
    "multipass_prefetch_config": ((None,), "prefetch runs in one pass"),
    "tbe_input_multiplexer_config": ((None,), "input multiplexing is not supported"),
    "embedding_shard_info": ((None,), "raw embedding streaming is not supported"),
    "enable_raw_embedding_streaming": ((False,), "raw embedding streaming is not supported"),
    "res_params": ((None,), "raw embedding streaming is not supported"),
    "is_qr_tbe": ((False,), "QR embeddings are not supported"),
    "preallocated_host_buffers": ((None,), "host tiers are allocated by the table"),
}

#: TorchRec's UVM-cache keywords: dynamic tables cache by their own options.
_UVM_CACHE = ("cache_algorithm", "cache_load_factor", "cache_sets", "cache_reserved_memory")

#: Keywords naming the rows' dtype (``with_precision``): float32, float16 or bfloat16.
_ROW_PRECISIONS = ("weights_precision", "cache_precision")

#: Keywords naming the dtype of ids or offsets given (int64 or int32 both work).
_INDEX_DTYPES = ("embedding_table_index_type", "embedding_table_offset_type")


def _as_dtype(value: Any) -> Any:
    """torch dtype of a torch dtype, FBGEMM ``SparseType`` or TorchRec ``DataType``."""
    if isinstance(value, torch.dtype):
        return value
    if hasattr(value, "as_dtype"):  # fbgemm_gpu SparseType
        return value.as_dtype()
    name = getattr(value, "name", value)
    return {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}.get(
        str(name).upper(), value)


def output_dtype_of(value: Any) -> torch.dtype:
    """The output dtype a keyword names (torch dtype, ``SparseType`` or ``DataType``).

    Raises:
        ValueError: not float32, float16 or bfloat16.
    """
    dtype = _as_dtype(value)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"output_dtype must be float32, float16 or bfloat16, got {value}")
    return dtype


def _equal(value: Any, accepted: tuple) -> bool:
    try:
        return any(value is a or (a is not None and value == a) for a in accepted)
    except (TypeError, ValueError, RuntimeError):
        return False


def check_tbe_keywords(kwargs: Mapping[str, Any]) -> None:
    """Checks FBGEMM's or upstream's table keywords that are not module parameters.

    Raises:
        ValueError: a keyword asks for a feature dynamic tables do not have (named,
            with what to use instead).
        TypeError: a keyword neither FBGEMM nor upstream dynamicemb defines.
    """
    for name, value in kwargs.items():
        if name in _ALWAYS_HONOURED:
            continue
        if name in _OFF_ONLY:
            accepted, why = _OFF_ONLY[name]
            if not _equal(value, accepted):
                raise ValueError(f"{name}={value!r} is not supported by dynamic tables: {why} "
                                 f"(accepted: {list(accepted)})")
        elif name in _UVM_CACHE:
            raise ValueError(f"{name} configures TorchRec's UVM cache; a dynamic table caches by "
                             "its DynamicEmbTableOptions (caching, local_hbm_for_values or "
                             "global_hbm_for_values)")
        elif name in _ROW_PRECISIONS:
            if _as_dtype(value) not in ROW_DTYPES:
                raise ValueError(f"{name}={value} is not supported: dynamic tables store "
                                 f"{[str(d) for d in ROW_DTYPES]} rows")
        elif name == "stochastic_rounding":
            if not isinstance(value, bool):
                raise ValueError(f"stochastic_rounding must be a bool, got {value!r}")
        elif name in _INDEX_DTYPES:
            if _as_dtype(value) not in (torch.int64, torch.int32):
                raise ValueError(f"{name} must be torch.int64 or torch.int32, got {value}")
        else:
            raise TypeError(f"unknown table keyword {name!r}: not a parameter of dynamic tables, "
                            "FBGEMM's table-batched embedding or upstream dynamicemb")


def module_kwargs(fused_params: Optional[Mapping[str, Any]],
                  skip: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """A dynamic group's TorchRec fused params as validated ``BatchedDynamicEmbeddingTables``
    keywords: TorchRec's ``__register*`` flags and the caller's ``skip`` keys dropped,
    ``betas`` -> ``beta1``/``beta2``, ``lr`` -> ``learning_rate``.

    Raises:
        ValueError, TypeError: a param that dynamic tables cannot honour, named.
    """
    kwargs = {k: v for k, v in dict(fused_params or {}).items()
              if k not in skip and not k.startswith("__register")}
    if "betas" in kwargs:
        kwargs["beta1"], kwargs["beta2"] = (float(b) for b in kwargs.pop("betas"))
    if "lr" in kwargs:
        kwargs["learning_rate"] = kwargs.pop("lr")
    for name in ("learning_rate", "eps", "beta1", "beta2", "weight_decay",
                 "initial_accumulator_value", "max_gradient"):
        if name in kwargs:
            kwargs[name] = float(kwargs[name])
    DynamicEmbOptimizerArgs(**{k: v for k, v in kwargs.items() if k in OPTIMIZER_KEYWORDS})
    if "output_dtype" in kwargs:
        kwargs["output_dtype"] = output_dtype_of(kwargs["output_dtype"])
    check_tbe_keywords({k: v for k, v in kwargs.items()
                        if k not in OPTIMIZER_KEYWORDS and k != "output_dtype"})
    return kwargs


def with_precision(options: Sequence[DynamicEmbTableOptions], kwargs: Mapping[str, Any],
                   names: Sequence[str]) -> List[DynamicEmbTableOptions]:
    """The tables' options under FBGEMM's precision keywords (checked by
    ``check_tbe_keywords``): ``weights_precision`` is every table's ``embedding_dtype``,
    ``cache_precision`` must be it too (a cache holds the rows themselves), and
    ``stochastic_rounding=False`` rounds every table's updates to nearest.

    Raises:
        ValueError: a table's ``embedding_dtype`` differs from a precision keyword
            (both named).
    """
    out = list(options)
    if "weights_precision" in kwargs:
        dtype = _as_dtype(kwargs["weights_precision"])
        for t, o in enumerate(out):
            if o.embedding_dtype is not None and o.embedding_dtype != dtype:
                raise ValueError(f"table {names[t]!r}: embedding_dtype={o.embedding_dtype} but "
                                 f"weights_precision={kwargs['weights_precision']} ({dtype}); "
                                 f"give one dtype")
            if o.embedding_dtype is None and dtype != torch.float32:
                out[t] = dataclasses.replace(o, embedding_dtype=dtype)
    if "cache_precision" in kwargs:
        dtype = _as_dtype(kwargs["cache_precision"])
        for t, o in enumerate(out):
            if o.row_dtype != dtype:
                raise ValueError(f"table {names[t]!r}: cache_precision={kwargs['cache_precision']} "
                                 f"({dtype}) but its rows are {o.row_dtype}: a cache holds the "
                                 f"rows in their dtype (set weights_precision or embedding_dtype)")
    if kwargs.get("stochastic_rounding") is False:
        out = [dataclasses.replace(o, stochastic_rounding=False) for o in out]
    return out
