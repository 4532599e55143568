"""The CUDA sources: where they are, which file defines each kernel, the program text."""

import hashlib
import os
from typing import Tuple

__all__ = ["cuda_source_root", "kernel_program"]

# Each kernel and the file of csrc/cuda that defines it.
_KERNELS = {
    **dict.fromkeys(("demb_hash_keys", "demb_buckets_of", "demb_find", "demb_upsert",
                     "demb_undo_upsert", "demb_grow", "demb_erase",
                     "demb_erase_where", "demb_expire"),
                    "hash_table.cu"),
    **dict.fromkeys(("demb_cache_probe", "demb_cache_rank", "demb_promotion_order",
                     "demb_promote_rows"), "cache.cu"),
    **dict.fromkeys(("demb_dedup_insert", "demb_dedup_first", "demb_dedup_number"), "dedup.cu"),
    **dict.fromkeys(("demb_check_offsets", "demb_init_rows",
                     "demb_pooled_forward", "demb_sequence_forward",
                     "demb_place_grads", "demb_piece_counts", "demb_piece_sums",
                     "demb_fused_update",
                     "demb_per_sample_weight_grad"),
                    "embedding.cu"),
}


def cuda_source_root() -> str:
    """The folder holding ``cuda/`` and ``dynamicemb/`` headers (the repo's ``csrc``)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # A built package carries them as dynamicemb/csrc; a checkout has them at the root.
    for root in (os.path.join(package, "csrc"), os.path.join(os.path.dirname(package), "csrc")):
        if os.path.isdir(os.path.join(root, "cuda")):
            return root
    raise ImportError(f"dynamicemb's CUDA sources (csrc/cuda) were not found near {package}")


def kernel_program(root: str, digest: str, source: str) -> Tuple[str, Tuple[str, ...]]:
    """The code and NVRTC options ``CudaKernels`` hands CuPy for ``source``, a file of
    ``root/cuda``; the code carries ``digest`` so CuPy's disk cache sees header changes."""
    with open(os.path.join(root, "cuda", source)) as f:
        code = f"// sources {digest}\n" + f.read()
    return code, ("-std=c++17", f"-I{root}")


def _source_digest(root: str) -> str:
    """Hash of every source and header: CuPy's disk cache keys on the code string only."""
    digest = hashlib.sha256()
    for folder in ("cuda", "dynamicemb"):
        for name in sorted(os.listdir(os.path.join(root, folder))):
            with open(os.path.join(root, folder, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()
