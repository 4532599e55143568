"""New rows: each element a function of (seed, table, key, column), never a stream, so a key
starts with the same row whatever the batch, thread count, cache size or device."""

import zlib
from typing import List, Optional, Sequence, Tuple

import torch

from dynamicemb.ops.interface import InitSpec, NewRows, init_mode_code
from dynamicemb.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbTableOptions,
)

__all__ = ["RowInitializer", "init_spec", "init_stream"]


def init_stream(table_name: str) -> int:
    """A table's identity in the initializer's random stream: the CRC-32 of its name, so a
    key starts with the same row in every module that names the table alike."""
    return zlib.crc32(table_name.encode("utf-8"))


def init_spec(names: Sequence[str], options: Sequence[DynamicEmbTableOptions],
              train: bool = False, args: Optional[DynamicEmbInitializerArgs] = None,
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(T, 3) int64 (stream, mode code, seed) and (T, 5) float64 (mean, std_dev, lower,
    upper, value) of each table's eval initializer (``train``: its training one;
    ``args``: that one for every table, with the table's stream and bounds), as the
    kernels take them (``InitSpec``, in float32 there)."""
    ints, floats = [], []
    given = args
    for name, o in zip(names, options):
        args = given if given is not None else o.initializer_args if train else o.eval_initializer_args
        lower, upper = args.bounds(o.max_capacity)
        ints.append([init_stream(name), init_mode_code(args.mode), args.seed])
        floats.append([args.mean, args.std_dev, lower, upper, args.value])
    return (torch.tensor(ints, dtype=torch.int64),
            torch.tensor(floats, dtype=torch.float64))


class RowInitializer:
    """The initial rows (embedding and optimizer state) of a group's logical tables, given
    in local table id order."""

    def __init__(self, table_names: List[str],
                 options: List[DynamicEmbTableOptions], dim: int,
                 optimizer: DynamicEmbOptimizerArgs, state_dim: int) -> None:
        self.dim = dim
        adagrad = optimizer.optimizer in (DynamicEmbOptimType.EXACT_ADAGRAD,
                                          DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD)
        self.state_dim = state_dim
        #: The first value of every optimizer-state float.
        self.initial_state = optimizer.initial_accumulator_value if adagrad else 0.0
        self._names, self._options = list(table_names), list(options)
        self._specs = {}  # (train, device) -> InitSpec

    def spec(self, train: bool, device: torch.device,
             others: Optional[DynamicEmbInitializerArgs] = None) -> InitSpec:
        """The tables' training (or eval) initializers packed for the kernels on ``device``
        (built once). ``others``: T more rows follow, table t's with ``others`` (table id
        T + t: rows of keys that admission has not admitted yet)."""
        key = (train, device, None if others is None else repr(others))  # not hashable
        if key not in self._specs:
            ints, floats = init_spec(self._names, self._options, train)
            if others is not None:
                more_ints, more_floats = init_spec(self._names, self._options, args=others)
                ints, floats = torch.cat([ints, more_ints]), torch.cat([floats, more_floats])
            self._specs[key] = InitSpec(ints.to(device), floats.to(device, torch.float32))
        return self._specs[key]

    def new_rows(self, device: torch.device) -> NewRows:
        """What a stored row starts as (embedding and optimizer state), on ``device``."""
        return NewRows(self.spec(True, device), self.dim, self.initial_state)
