"""A batch padded to a fixed number of lookups, for a step captured in a CUDA graph (which
replays with the shapes it was captured with)."""

from typing import Optional, Tuple

import torch

__all__ = ["pad_lookups"]


def pad_lookups(indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor], num_lookups: int,
                padding_id: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch with ``num_lookups`` lookups: the missing ones are ``padding_id`` with
    weight 0 at the end of the last bag (SUM pooling, the only pooling with weights), adding
    nothing to any output.

    Args:
        indices (Tensor): (N,) ids, N <= ``num_lookups``.
        offsets (Tensor): (F * B + 1,) bag boundaries, the last one N.
        per_sample_weights (Tensor, optional): (N,) weights; default 1 each.
        num_lookups: the fixed lookup count.
        padding_id: an id no batch uses (its one row is stored and trains on zero
            gradients; under Adam its moments decay; no other row sees the padding).

    Returns:
        (indices (num_lookups,), offsets with the last entry ``num_lookups``,
        float32 weights (num_lookups,)).

    Raises:
        ValueError: when the batch has more lookups than ``num_lookups`` or no bag.

    Example::

        ids, offsets, weights = pad_lookups(batch_ids, batch_offsets, None, 65536, -1)
        static_ids.copy_(ids); static_offsets.copy_(offsets); static_weights.copy_(weights)
        graph.replay()
    """
    n = indices.numel()
    if n > num_lookups:
        raise ValueError(f"the batch has {n} lookups, more than num_lookups={num_lookups}")
    if offsets.numel() < 2:
        raise ValueError("offsets must bound at least one bag to pad")
    if per_sample_weights is not None and per_sample_weights.shape != (n,):
        raise ValueError(f"per_sample_weights must have shape ({n},) like indices, "
                         f"got {tuple(per_sample_weights.shape)}")
    extra = num_lookups - n
    weights = (torch.ones(n, dtype=torch.float32, device=indices.device)
               if per_sample_weights is None else per_sample_weights.to(torch.float32))
    fixed_ids = torch.cat([indices, torch.full((extra,), int(padding_id),
                                               dtype=indices.dtype, device=indices.device)])
    fixed_weights = torch.cat([weights, weights.new_zeros(extra)])
    fixed_offsets = offsets.clone()
    fixed_offsets[-1] = num_lookups  # the last bag takes the padding
    return fixed_ids, fixed_offsets, fixed_weights
