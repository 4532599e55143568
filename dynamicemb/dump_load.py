"""Upstream dynamicemb's module path of its checkpoint functions (re-exported from
``dynamicemb.checkpoint``; ``docs/CHECKPOINTS.md``)."""

from dynamicemb.checkpoint import DynamicEmbDump, DynamicEmbLoad

__all__ = ["DynamicEmbDump", "DynamicEmbLoad"]
