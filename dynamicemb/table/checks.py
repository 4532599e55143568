"""Checks of user-given tensors, written once for the table and the module layer."""

from dataclasses import dataclass
from typing import Optional

import torch

from dynamicemb.ops.interface import ScoreRule
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["TableInputs", "check_batch_types", "check_frequencies", "check_keys",
           "table_ids_as_int16"]


def check_keys(keys: torch.Tensor) -> None:
    """Raises unless ``keys`` is a 1-D int64 tensor."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
    if keys.dtype != torch.int64:
        raise TypeError(f"keys must be int64, got {keys.dtype}")
    if keys.dim() != 1:
        raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")


def check_batch_types(indices, offsets, weights, weights_allowed: str = "") -> None:
    """Raises unless ``indices`` and ``offsets`` are 1-D int32/int64 and ``weights`` is None
    or floating point; a non-empty ``weights_allowed`` says why weights are refused."""
    for name, t in (("indices", indices), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if weights is None:
        return
    if weights_allowed:
        raise ValueError(f"per_sample_weights need SUM pooling, {weights_allowed}")
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise TypeError("per_sample_weights must be a floating-point tensor")


def check_frequencies(frequencies: Optional[torch.Tensor], n: int, device: torch.device,
                      like: str = "keys", int32: bool = False,
                      check_values: bool = True) -> Optional[torch.Tensor]:
    """``frequencies`` ((n,) int64, or int32 where ``int32``; each >= 1) as a contiguous
    int64 tensor on ``device``, or None. ``like`` names the shape for the message;
    ``check_values`` reads the counts on the host (a GPU step does not).

    Raises:
        TypeError, ValueError: on a wrong dtype, shape or a count below 1.
    """
    if frequencies is None:
        return None
    dtypes = (torch.int32, torch.int64) if int32 else (torch.int64,)
    if not isinstance(frequencies, torch.Tensor) or frequencies.dtype not in dtypes:
        raise TypeError(f"frequencies must be an {' or '.join(str(d)[6:] for d in dtypes)} "
                        f"tensor, got {getattr(frequencies, 'dtype', type(frequencies).__name__)}")
    if frequencies.shape != (n,):
        raise ValueError(
            f"frequencies must have shape ({n},) like {like}, got {tuple(frequencies.shape)}")
    if check_values and n and int(frequencies.min()) < 1:
        raise ValueError("frequencies must be >= 1")
    return frequencies.to(device=device, dtype=torch.int64).contiguous()


def table_ids_as_int16(table_ids: torch.Tensor, n: int, num_tables: int) -> torch.Tensor:
    """``table_ids`` checked against ``num_tables`` and stored as int16."""
    if not isinstance(table_ids, torch.Tensor):
        raise TypeError(f"table_ids must be a torch.Tensor, got {type(table_ids).__name__}")
    if table_ids.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"table_ids must be int32 or int64, got {table_ids.dtype}")
    if table_ids.shape != (n,):
        raise ValueError(
            f"table_ids must have shape ({n},) like keys, got {tuple(table_ids.shape)}"
        )
    if n > 0:
        low, high = (int(x) for x in torch.aminmax(table_ids))
        if low < 0 or high >= num_tables:
            raise ValueError(
                f"table_ids must be in [0, {num_tables}), got values in [{low}, {high}]"
            )
    return table_ids.to(torch.int16).contiguous()


@dataclass(frozen=True)
class TableInputs:
    """The argument checks of ``ScoredHashTable``'s verbs (raising before any change)."""

    device: torch.device
    num_tables: int
    score_strategy: DynamicEmbScoreStrategy
    rule: ScoreRule
    value_dim: int
    value_dtype: torch.dtype

    def table_ids(self, table_ids: Optional[torch.Tensor], n: int,
                   checked: bool = False) -> torch.Tensor:
        """The kernels' int16 ids; ``checked``: built in range by the caller, not read on the
        host (a GPU sync)."""
        if table_ids is None:
            return torch.zeros(n, dtype=torch.int16, device=self.device)
        if checked and table_ids.shape == (n,):
            return self.here(table_ids, "table_ids").to(torch.int16).contiguous()
        tids = table_ids_as_int16(table_ids, n, self.num_tables)
        return self.here(tids, "table_ids")

    def keys(self, keys: torch.Tensor) -> torch.Tensor:
        check_keys(keys)
        return self.here(keys, "keys").contiguous()

    def here(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t``, if on the table's device (kernels take raw pointers)."""
        if t.device != self.device:
            raise ValueError(f"{name} are on {t.device}, the table on {self.device}")
        return t

    def given_scores(self, scores: Optional[torch.Tensor], n: int,
                      exact: bool = False, checked: bool = False) -> Optional[torch.Tensor]:
        """CUSTOMIZED: the scores (required). LFU: counts to add (default 1). ``exact``: the
        scores to store, whatever the strategy (required)."""
        customized = self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED or exact
        lfu = self.rule in (ScoreRule.COUNT, ScoreRule.COUNT_THEN_CLOCK) and not exact
        if scores is None:
            if exact:
                raise ValueError("exact_scores=True needs scores for every key")
            if customized:
                raise ValueError("the CUSTOMIZED score strategy needs scores for every key")
            return torch.ones(n, dtype=torch.int64, device=self.device) if lfu else None
        if not (customized or lfu):
            raise ValueError(
                f"scores are only accepted with the CUSTOMIZED strategy (and as counts with "
                f"LFU), this table uses {self.score_strategy.name}"
            )
        if not isinstance(scores, torch.Tensor) or scores.dtype != torch.int64:
            raise TypeError(f"scores must be an int64 tensor, got {getattr(scores, 'dtype', type(scores))}")
        if scores.shape != (n,):
            raise ValueError(f"scores must have shape ({n},), got {tuple(scores.shape)}")
        self.here(scores, "scores")
        if n > 0 and not checked and int(scores.min()) < (1 if lfu else 0):
            raise ValueError("LFU counts must be >= 1" if lfu else "scores must be >= 0")
        return scores.contiguous()

    def rows(self, values: Optional[torch.Tensor], n: int) -> torch.Tensor:
        if values is None:
            if self.value_dim == 0:
                return torch.empty(n, 0, dtype=self.value_dtype, device=self.device)
            raise ValueError(f"values of shape ({n}, {self.value_dim}) are required")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != self.value_dtype:
            raise TypeError(f"values must be {self.value_dtype}, got {values.dtype}")
        if values.shape != (n, self.value_dim):
            raise ValueError(
                f"values must have shape ({n}, {self.value_dim}), got {tuple(values.shape)}"
            )
        return values
