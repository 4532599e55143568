"""Which rank stores a key of a row-wise dynamic table: the ``dist_type`` functions.

Each function maps an int64 key to a 64-bit word read as unsigned; the owner of the
key among ``W`` ranks is that word mod ``W``:

- ``hash`` (the default): splitmix64's finalizer (``splitmix64``);
- ``roundrobin``: the key itself (upstream's ``key % W``; a negative key counts as
  ``key + 2**64``, as upstream's uint64 cast reads it);
- ``hash_roundrobin``: murmur3's 64-bit finalizer (``fmix64``), upstream's.

The input dist, the kernels' ownership checks, checkpoint loading and the DMP state
dict all ask ``owner_rank`` (or ``placement_word``, which the input dist bucketizes),
so a key is looked up, trained, saved and restored on the same rank. Torch only: no
TorchRec import.
"""

from typing import Union

import torch

from dynamicemb.types import DynamicEmbDistType

__all__ = ["DynamicEmbDistType", "fmix64", "owner_rank", "placement_word", "splitmix64"]

_MASK = [(1 << (64 - s)) - 1 for s in range(64)]


def _shift_right_logical(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & _MASK[s]


def _signed(constant: int) -> int:
    """A 64-bit multiplier as the int64 with the same bits (products wrap)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


def splitmix64(keys: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (Stafford's Mix13) of the raw keys, as int64 bits.

    Bijective on 64 bits. It is deliberately not the table's bucket hash
    (``dynamicemb.table.hash_keys``): that hash picks buckets from its low bits, so
    routing with it would leave each rank only 1/W of its buckets usable.

    Args:
        keys (Tensor): (n,) int64 (or int32, widened), any value.

    Returns:
        (n,) int64: the mixed 64-bit words (read as unsigned).
    """
    return _mix(keys, (30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def fmix64(keys: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer of the raw keys, as int64 bits: upstream's
    ``hash_roundrobin`` hash (``hash_key`` of its bucketize kernel).

    Args:
        keys (Tensor): (n,) int64 (or int32, widened), any value.

    Returns:
        (n,) int64: the mixed 64-bit words (read as unsigned).
    """
    return _mix(keys, (33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53))


def _mix(keys: torch.Tensor, shifts, multipliers) -> torch.Tensor:
    """The xorshift-multiply finalizer both hashes share: x ^= x >> s0; x *= m0;
    x ^= x >> s1; x *= m1; x ^= x >> s2 (64-bit wrapping, shifts logical)."""
    x = keys.to(torch.int64)
    for shift, multiplier in zip(shifts, multipliers):
        x = x ^ _shift_right_logical(x, shift)
        x = x * _signed(multiplier)
    return x ^ _shift_right_logical(x, shifts[-1])


def placement_word(keys: torch.Tensor, dist_type: Union[DynamicEmbDistType, str]) -> torch.Tensor:
    """The 64-bit word whose unsigned value mod ``W`` is each key's owner.

    Args:
        keys (Tensor): (n,) int64 (or int32, widened).
        dist_type: a ``DynamicEmbDistType`` or its value.

    Returns:
        (n,) int64: ``splitmix64(key)``, the key itself, or ``fmix64(key)``.
    """
    dist_type = DynamicEmbDistType(dist_type)
    if dist_type == DynamicEmbDistType.HASH:
        return splitmix64(keys)
    if dist_type == DynamicEmbDistType.HASH_ROUNDROBIN:
        return fmix64(keys)
    return keys.to(torch.int64)


def owner_rank(keys: torch.Tensor, world_size: int,
               dist_type: Union[DynamicEmbDistType, str] = DynamicEmbDistType.HASH) -> torch.Tensor:
    """The rank that stores each key of a row-wise dynamic table:
    ``uint64(placement_word(key, dist_type)) % world_size``.

    Args:
        keys (Tensor): (n,) int64.
        world_size: number of shards (ranks) of the table.
        dist_type: the table's ``DynamicEmbTableOptions.dist_type`` (default: the
            options' default, ``hash``).

    Returns:
        (n,) int64 ranks in ``[0, world_size)``.

    Raises:
        ValueError: ``world_size`` < 1, or an unknown ``dist_type``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    word = placement_word(keys, dist_type)
    # uint64 % W with int64 ops: (2 * (w >>> 1) + (w & 1)) % W
    return ((_shift_right_logical(word, 1) % world_size) * 2 + (word & 1)) % world_size
