"""The one check that TorchRec is installed, for the packages built on it
(``dynamicemb.shard``, ``dynamicemb.planner``, ``dynamicemb.plan``'s translation)."""

__all__ = ["require_torchrec"]

_HOW = (
    "{what} needs TorchRec: pip install 'dynamicemb[torchrec]'. On a machine without "
    "CUDA, install the CPU build of FBGEMM first and TorchRec without its dependencies, "
    "so that pip does not pull in the CUDA fbgemm-gpu: pip install fbgemm-gpu-cpu, then "
    "pip install --no-deps torchrec (and TorchRec's own dependencies: tensordict, "
    "torchmetrics, tqdm, pyre-extensions, iopath).")


def require_torchrec(what: str) -> None:
    """Raises an ``ImportError`` naming ``what`` and how to install TorchRec if it is missing."""
    try:
        import torchrec  # noqa: F401, PLC0415
    except ImportError as err:
        raise ImportError(_HOW.format(what=what)) from err
