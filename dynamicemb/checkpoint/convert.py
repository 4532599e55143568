"""``convert_row_dtypes``: a module's saved state dict with its rows in the model's dtypes."""

from typing import Any, Dict

from torch import nn

from dynamicemb.embedding import BatchedDynamicEmbeddingTables
from dynamicemb.embedding.state import convert_tables_state

__all__ = ["convert_row_dtypes"]


def convert_row_dtypes(state_dict: Dict[str, Any], model: nn.Module) -> Dict[str, Any]:
    """``state_dict`` with the rows of every ``BatchedDynamicEmbeddingTables`` of
    ``model`` in the dtype of its table there, for ``model.load_state_dict``.

    ``load_state_dict`` refuses a table saved in another embedding dtype, naming both;
    this converts such tables on purpose: embeddings are rounded to nearest (even) into
    the table's dtype (float16/bfloat16 into float32: exact), as ``import_keys_values``
    rounds them, and their headers name that dtype. Optimizer states are float32 in
    every table and stay as they are; so does everything else. Unsharded modules'
    entries (``<path>._extra_state``) only: a DMP model's dynamic tables convert with
    ``DynamicEmbLoad(..., convert_dtype=True)``.

    Args:
        state_dict: a state dict of ``model`` (``torch.load(f, weights_only=True)``).
        model: the module to load it into, or a module containing it.

    Returns:
        A new dict (the entries it does not convert are shared); ``state_dict`` is
        unchanged.

    Example::

        state = torch.load("tables.pt", weights_only=True)   # saved in float32
        model.load_state_dict(convert_row_dtypes(state, model))  # bfloat16 tables
    """
    converted = dict(state_dict)
    for path, module in model.named_modules():
        key = f"{path}._extra_state" if path else "_extra_state"
        if isinstance(module, BatchedDynamicEmbeddingTables) and key in converted:
            converted[key] = convert_tables_state(module, converted[key])
    return converted
