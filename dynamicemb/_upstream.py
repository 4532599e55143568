"""Upstream dynamicemb's names in the modules that carry its module paths: names
defined in another layer are imported when first used (so no import cycle and no
TorchRec import until asked), and names this package does not provide are refused
with an ``ImportError`` that says what to use instead (``docs/MIGRATING.md``)."""

import importlib
from typing import Any, Callable, Iterable, Mapping

__all__ = ["REFUSED", "module_getattr"]

_TORCH_DTYPES = "tables take torch dtypes (rows are float32)"
_STORAGE_INTERFACE = ("the storage and cache interfaces do not exist here (external_storage is "
                      "refused); DynamicEmbTableOptions' caching and local_hbm_for_values / "
                      "global_hbm_for_values choose where rows live")

#: Upstream's names not provided here -> what to use instead (one text per name,
#: whichever of upstream's modules it is imported from).
REFUSED: Mapping[str, str] = {
    "AdmissionStrategy": "admission is FrequencyAdmissionStrategy(threshold=...) (no strategy "
                         "classes of your own)",
    "ScoreStrategy": "score_strategy is one DynamicEmbScoreStrategy (compound tuples are "
                     "refused)",
    "BATCH_SIZE_PER_DUMP": "DynamicEmbDump streams rows in chunks of its own; "
                           "export_keys_values(name, device, batch_size) takes a batch size",
    "data_type_to_dyn_emb": _TORCH_DTYPES,
    "dyn_emb_to_torch": _TORCH_DTYPES,
    "torch_to_dyn_emb": _TORCH_DTYPES,
    "data_type_to_dtype": "use torchrec.modules.embedding_configs.data_type_to_dtype",
    "string_to_evict_strategy": "use DynamicEmbEvictStrategy(name)",
    "MemoryType": "Counter.memory_usage() takes no memory type and returns all bytes held",
    "COUNTER_TYPE": "admission counts are float64 here (export_admission_counters(name).counts)",
    "torch_dtype_to_np_dtype": "call .numpy() on the exported tensors (keys int64, rows float32)",
    "DTYPE_NUM_BYTES": "use dtype.itemsize (rows are float32: get_table_value_bytes sizes them)",
    "tabulate": "it is upstream's printing helper; format tables with your own code",
    "assert_tensors_equal": "use torch.testing.assert_close",
    **{name: _STORAGE_INTERFACE
       for name in ("Storage", "Cache", "CopyMode", "OptionsT", "OptimizerT")},
}


def module_getattr(module: str, lazy: Mapping[str, str],
                   refused: Iterable[str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for upstream's names.

    Args:
        module: the module's ``__name__``, for the messages.
        lazy: name -> ``"package.module:attribute"`` it is, imported on first use.
        refused: names of ``REFUSED`` that upstream's module of this path has.

    Returns:
        The ``__getattr__``: a lazy name's object; ``ImportError`` for a refused
        name (``from module import name`` shows its message); ``AttributeError``
        for any other name.
    """
    refused = frozenset(refused)
    unknown = refused - set(REFUSED)
    if unknown:
        raise ValueError(f"no replacement text for {sorted(unknown)}")

    def __getattr__(name: str) -> Any:
        if name in lazy:
            path, _, attribute = lazy[name].partition(":")
            return getattr(importlib.import_module(path), attribute)
        if name in refused:
            raise ImportError(f"{module}.{name} is upstream dynamicemb's and is not provided "
                              f"here: {REFUSED[name]} (docs/MIGRATING.md)", name=name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
