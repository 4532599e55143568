"""Plain-Python references of the ``dist_type`` placement functions (no torch, no
dynamicemb): what the tests expect ``dynamicemb.placement`` to compute."""

M64 = (1 << 64) - 1


def splitmix64(key: int) -> int:
    """splitmix64's finalizer of the key read as uint64."""
    z = key & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def fmix64(key: int) -> int:
    """MurmurHash3's fmix64 of the key read as uint64 (upstream's ``hash_key``)."""
    k = key & M64
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


#: dist_type value -> the 64-bit word whose value mod W is the owner
WORDS = {
    "hash": splitmix64,
    "roundrobin": lambda key: key & M64,  # upstream's uint64 cast
    "hash_roundrobin": fmix64,
}


def owner(key: int, world_size: int, dist_type: str) -> int:
    """The rank a key of a row-wise table lives on."""
    return WORDS[dist_type](key) % world_size
